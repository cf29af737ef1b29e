"""What a new user does first: point the quickstart at their own files. The defaults must not bite, and a
whole-file mistake is one line about the file, not a row-level hint that leads nowhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_helpers import write_parquet

from veomni.train.cli import main
from veomni.train.recipe import ASSETS_DIR

SHORT = [
    "--train.steps=2", "--train.epochs=null", "--optim.warmup_steps=1", "--train.eval_interval=null", "--data.eval_files=[]",
    "--checkpoint.hf_export=false", "--checkpoint.save_final=false",
]  # fmt: skip


def _quickstart_rows_as_parquet(tmp_path):
    rows = [json.loads(line) for line in (ASSETS_DIR / "quickstart" / "train.jsonl").read_text().splitlines()]
    return write_parquet(tmp_path / "train.parquet", rows[:64])


def test_a_parquet_run_with_a_log_file_and_a_profiled_step(tmp_path, capsys):
    # One short quickstart run (each costs ~40 s on 2 cores) holds three first-contact paths: the user's parquet
    # file on the command line (data.file_format: auto), log.file, and log.profile_steps.
    data, out, log_file = _quickstart_rows_as_parquet(tmp_path), tmp_path / "run", tmp_path / "logs" / "train.log"
    code = main([
        "quickstart", f"--data.train_files=[{data}]", f"--log.file={log_file}", "--train.log_interval=1",
        "--log.profile_steps=[2,2]", f"--checkpoint.dir={out}", *SHORT,
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "done: 2 steps" in capsys.readouterr().out

    text = log_file.read_text()
    assert "rank0] INFO veomni.train: training 2 steps" in text
    assert "rank0] INFO veomni.train.console: step 2/2 | loss " in text and "| eta " in text
    assert "\r" not in text

    trace = json.loads((out / "profile" / "trace_rank_0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names  # the step's matmuls are in the window
    table = (out / "profile" / "top_ops.txt").read_text()
    assert table.startswith("steps 2..2, sorted by self_cpu_time_total") and "Self CPU" in table


def test_a_parquet_file_read_as_jsonl_is_one_line_about_the_file(tmp_path, capsys):
    data = _quickstart_rows_as_parquet(tmp_path)
    code = main([
        "quickstart", f"--data.train_files=[{data}]", "--data.file_format=jsonl",
        f"--checkpoint.dir={tmp_path / 'run'}", *SHORT,
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert f"{data}: read as jsonl (data.file_format), but the file holds a parquet file" in err
    assert "on_bad_row" not in err and "line 1" not in err and "Traceback" not in err


def _run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # A subprocess: huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported.
    return subprocess.run(
        [sys.executable, "-m", "veomni.train.cli", *args], capture_output=True, text=True,
        env={**os.environ, **env},
    )  # fmt: skip


def _cached_snapshot(cache: Path, repo_id: str) -> Path:
    """A Hub cache entry as huggingface_hub writes it: refs/main -> snapshots/<commit>/ (a tiny Qwen3 with the
    quickstart tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    config = AutoConfig.for_model(
        "qwen3", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
    for f in (ASSETS_DIR / "quickstart" / "tokenizer").iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_model_weights_by_hub_id_come_from_the_hub_cache(tmp_path):
    cache = tmp_path / "hub"
    _cached_snapshot(cache, "veomni-test/tiny-qwen3")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    result = _run_cli(
        "quickstart", "--model.weights=veomni-test/tiny-qwen3", "--model.config=null", "--model.tokenizer=null",
        f"--checkpoint.dir={tmp_path / 'run'}", *SHORT, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 2 steps" in result.stdout
    # The saved recipe names the id, not the cache directory it resolved to.
    assert "weights: veomni-test/tiny-qwen3" in (tmp_path / "run" / "recipe.yaml").read_text()

    preview = subprocess.run(
        [sys.executable, "-m", "veomni.train.data.preview", "quickstart", "--model.weights=veomni-test/tiny-qwen3",
         "--model.config=null", "--model.tokenizer=null", "--n", "1"],
        capture_output=True, text=True, env={**os.environ, **env},
    )  # fmt: skip
    assert preview.returncode == 0, preview.stderr[-2000:]
    assert "tokenizer: " in preview.stdout and "models--veomni-test--tiny-qwen3" in preview.stdout

    missing = _run_cli(
        "quickstart", "--model.weights=veomni-test/not-cached", "--model.config=null", "--model.tokenizer=null",
        f"--checkpoint.dir={tmp_path / 'run2'}", *SHORT, env=env,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "Traceback" not in missing.stderr
    assert (
        "model.weights: 'veomni-test/not-cached' is not a local path and reads as a Hugging Face Hub id, but it is "
        "not in the local cache and the Hub cannot be reached" in missing.stderr
    )


def test_a_weights_path_that_does_not_exist_is_one_line(tmp_path, capsys):
    code = main(["quickstart", f"--model.weights={tmp_path / 'nowhere'}", "--model.config=null",
                 f"--checkpoint.dir={tmp_path / 'run'}", *SHORT])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"model.weights: no such file or directory: {tmp_path / 'nowhere'}" in err


def test_weights_that_cannot_give_the_config_are_one_line(tmp_path, capsys):
    # With model.config null the config is read from model.weights: a safetensors file was parsed as JSON (a
    # UnicodeDecodeError blamed on model.config_overrides), a directory without config.json was a traceback.
    weights = _cached_snapshot(tmp_path / "hub", "x/y")
    common = ["--model.config=null", "--model.tokenizer=null", f"--checkpoint.dir={tmp_path / 'run'}", *SHORT]
    assert main(["quickstart", f"--model.weights={weights / 'model.safetensors'}", *common]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"veomni-train: PreflightError: model.weights: {weights / 'model.safetensors'} is a file, and with "
        f"model.config null the model config is read from the weights: give the checkpoint directory ({weights}, "
        "if it holds config.json), or set model.config"
    )
    (weights / "config.json").unlink()
    assert main(["quickstart", f"--model.weights={weights}", *common]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"model.weights: {weights} holds no config.json to read the model config from; set model.config" in err


def test_bad_tokenizer_config_and_run_directories_are_one_line_each(tmp_path, capsys):
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "no_tokenizer" / "model.safetensors").write_bytes(b"")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "a_file").write_text("")
    cases = {
        "--model.tokenizer=" + str(tmp_path / "no_tokenizer"): (
            f"model.tokenizer: {tmp_path / 'no_tokenizer'} holds no tokenizer files (none of tokenizer.json, "
            "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, *.tiktoken); it holds ['model.safetensors']"
        ),
        "--model.tokenizer=" + str(tmp_path / "bad.json"): (
            f"model.tokenizer: {tmp_path / 'bad.json'} is a file; expected the directory that holds the tokenizer "
            f"files ({tmp_path})"
        ),
        "--model.config=" + str(tmp_path / "bad.json"): f"model.config: {tmp_path / 'bad.json'} is not valid JSON: ",
        "--checkpoint.dir=" + str(tmp_path / "a_file" / "run"): (
            f"checkpoint.dir: cannot create {tmp_path / 'a_file' / 'run'}: Not a directory"
        ),
    }
    for arg, message in cases.items():
        assert main(["quickstart", f"--checkpoint.dir={tmp_path / 'run'}", *SHORT, arg]) == 2, arg
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith(f"veomni-train: PreflightError: {message}"), (arg, err)


def test_pickle_only_weights_are_refused_with_the_conversion_to_run(tmp_path, capsys):
    weights = _cached_snapshot(tmp_path / "hub", "x/y")
    for f in weights.glob("*.safetensors"):
        f.unlink()
    (weights / "pytorch_model.bin").write_bytes(b"not read")
    code = main(["quickstart", f"--model.weights={weights}", "--model.config=null", "--model.tokenizer=null",
                 f"--checkpoint.dir={tmp_path / 'run'}", *SHORT])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "holds PyTorch pickle weights ['pytorch_model.bin'] but no safetensors (read whole into every" in err
    assert "save_pretrained(out)" in err


@pytest.mark.parametrize(("field", "extra"), [("log.tensorboard_dir", "tensorboard"), ("log.wandb_project", "wandb")])
def test_a_sink_whose_extra_is_missing_is_one_line_before_the_build(tmp_path, capsys, monkeypatch, field, extra):
    # None in sys.modules is how Python itself marks a module as not importable: find_spec answers None and
    # `import` raises, as without the package (so the test holds where the extras are installed too).
    monkeypatch.setitem(sys.modules, extra, None)
    code = main(["quickstart", f"--{field}={tmp_path / 'sink'}", f"--checkpoint.dir={tmp_path / 'run'}", *SHORT])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"veomni-train: PreflightError: {field} is set but {extra} is not installed: pip install "
        f"'veomni-train[{extra}]' (in a checkout of this repository: uv sync --all-packages --extra {extra})"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything ran


def test_profile_steps_must_be_an_ordered_window(tmp_path, capsys):
    assert main(["quickstart", "--log.profile_steps=[3,2]", "--print"]) == 2
    assert "log.profile_steps: expected [first, last] with 1 <= first <= last, found [3, 2]" in capsys.readouterr().err


def test_data_files_accept_globs_and_shard_directories(tmp_path):
    from data_helpers import text_rows, write_jsonl

    from veomni.train.data.sources import DataError, RowSource

    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        write_jsonl(shards / f"part-{i:02d}.jsonl", text_rows(4, seed=i))
    (shards / "README.md").write_text("not data")
    by_dir = RowSource([str(shards)], "auto", ["text"])
    by_glob = RowSource([str(tmp_path / "**" / "part-*.jsonl")], "auto", ["text"])
    for source in (by_dir, by_glob):
        assert len(source) == 12
        assert [f.path for f in source.files] == [str(shards / f"part-{i:02d}.jsonl") for i in range(3)]
        assert source.ref(11).file.endswith("part-02.jsonl")
    with pytest.raises(DataError, match=r"part-\*\.parquet: the pattern matches no file"):
        RowSource([str(shards / "part-*.parquet")], "auto", ["text"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: a directory with no .jsonl, .json, .parquet, .arrow file and not a save_to_disk dataset"):
        RowSource([str(tmp_path / "empty")], "auto", ["text"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_train_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    assert main(["quickstart", "--train.device=cuda", f"--checkpoint.dir={tmp_path / 'run'}", *SHORT]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("veomni-train: PreflightError: train.device: cuda, but torch ")
    assert "sees no CUDA device" in err


def test_data_preview_of_a_directory_without_a_tokenizer_is_one_line(tmp_path, capsys):
    from veomni.train.data.preview import main as preview

    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")
    assert preview(["quickstart", f"--model.tokenizer={tmp_path / 'weights'}", "--n", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"veomni-data-preview: error: model.tokenizer: {tmp_path / 'weights'} holds no tokenizer files (none of "
        "tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, *.tiktoken); it holds "
        "['config.json']"
    ]
