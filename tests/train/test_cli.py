"""The CLI surface: every shipped recipe validates, `--help` documents every field, `--print` round-trips,
errors exit 2 with the reason, and veomni-doctor reports the kernel backends."""

from __future__ import annotations

import json
import logging
import re

import pytest
import yaml

from veomni.train.cli import main
from veomni.train.doctor import report
from veomni.train.recipe import RECIPES_DIR, builtin_recipes, load_recipe, recipe_fields


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_shipped_recipe_validates(name):
    recipe = load_recipe(name)
    single = (
        "quickstart",
        "quickstart_vlm",
        "quickstart_omni",
        "quickstart_dit",
        "quickstart_lora",
        "quickstart_dpo",
        "quickstart_reward",
        "qwen3_8b_lora",
        "qwen3_0.6b",
        "qwen3_1.7b",
        "qwen3_vl_2b",
    )
    dp = 1 if name in single else 8
    assert recipe.grad_accum(dp) >= 1


# DiT recipes bind no veomni kernels (diffusers' own model); the quickstarts run on the CPU.
@pytest.mark.parametrize(
    "name",
    [n for n in builtin_recipes() if not n.startswith("quickstart") and load_recipe(n).model.task != "dit"],
)
def test_shipped_gpu_recipes_choose_runnable_kernels_on_an_h100(name):
    """The GPU recipes' explicit kernel choices (varlen attention for packed rows) validate on sm_90."""
    from veomni.kernels.hardware import Hardware

    recipe = load_recipe(name)
    assert recipe.train.device == "cuda"
    ops = recipe.ops.to_ops_config(hardware=Hardware(device_type="cuda", capability=(9, 0)))
    # gpt-oss needs attention sinks, which varlen lacks: its recipes choose flex.
    assert ops.attention == ("flex" if name.startswith("gpt_oss") else "varlen")


def test_help_lists_every_field(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(field in text for field in recipe_fields())
    assert "parallel.activation_checkpointing" in text


def test_print_shows_the_resolved_recipe_with_overrides(capsys):
    assert main(["quickstart", "--optim.lr=1e-4", "--print"]) == 0
    assert "lr: 0.0001" in capsys.readouterr().out


def test_print_without_a_recipe_is_a_usage_error(capsys):
    assert main(["--print"]) == 2
    assert main(["--print", "--optim.lr=1e-4"]) == 2
    assert "the recipe comes first" in capsys.readouterr().err


def test_a_typo_exits_2_with_a_suggestion(capsys):
    assert main(["quickstart", "--optim.lrr=1e-4"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_doctor_reports_backends_and_why_not():
    text = report()
    assert "kernel backends on" in text and "torch" in text
    assert "moe_experts" in text and "cross_entropy" in text
    # Every backend with its variants, NPU acceptance and the reason it cannot run here (NPU and QuACK included).
    quack = next(line for line in text.splitlines() if " cross_entropy " in line and " quack " in line)
    assert (
        "npu:no" in quack
        and "[causal,seq_cls]" in quack
        and ("unavailable: " in quack or quack.endswith(" ok"))
    )
    npu = next(line for line in text.splitlines() if " rms_norm " in line and " npu " in line)
    assert "npu:ok" in npu
    if "kernel backends on npu" not in text:
        assert "unavailable: rms_norm/standard on 'npu' needs npu" in npu
    assert "defaults here: attention=" in text


def test_veomni_train_under_torchrun_on_two_cpu_ranks(tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "veomni.train.cli", "quickstart", "--train.steps=3", "--train.epochs=null",
        "--train.eval_interval=null", "--data.eval_files=[]", "--optim.warmup_steps=1", f"--checkpoint.dir={out}",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 3 steps" in result.stdout
    assert (out / "step_00000003" / "COMPLETE").is_file()
    assert (out / "step_00000003" / "rank_00001.pt").is_file()  # both ranks wrote their state
    AutoModelForCausalLM.from_pretrained(
        out / "hf"
    )  # the export of a 2-rank FSDP run loads in plain transformers


def test_bad_input_found_before_the_build_exits_2_without_a_traceback(tmp_path, capsys):
    # A freeze pattern that names no module is found on the meta model, before data or weights are touched.
    code = main(["quickstart", "--model.freeze=[model.visual]", f"--checkpoint.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "PreflightError: model.freeze: ['model.visual'] match no module" in err and "top-level modules" in err
    )
    assert "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_diverged_run_exits_1_naming_the_step_without_a_traceback(tmp_path, capsys):
    from test_loop import DENSE, tiny_recipe

    from veomni.train.recipe import recipe_from_dict, save_recipe

    # lr 1e30: the first update sends the weights to ~1e30, and the second step's gradients are nan.
    raw = tiny_recipe(str(tmp_path / "run"), DENSE, steps=3, tokens_per_step=256, tokens_per_micro_batch=256)
    raw["optim"].update({"lr": 1e30, "warmup_steps": 0, "max_grad_norm": None})
    path = save_recipe(recipe_from_dict(raw), tmp_path / "diverging.yaml")
    code = main([str(path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "TrainingDivergedError: step 2 diverged" in err and "Traceback" not in err
    # The metrics file stays strict JSON: the diverged step's NaN is the string "NaN", not a bare token.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()

    def refuse(token: str) -> None:
        raise AssertionError(f"bare {token} in metrics.jsonl")

    records = [json.loads(line, parse_constant=refuse) for line in lines]
    diverged = [r for r in records if r.get("diverged")]
    assert len(diverged) == 1 and "NaN" in (diverged[0]["loss"], diverged[0]["grad_norm"])


def test_following_the_divergence_advice_trains_past_the_diverged_step(tmp_path, capsys, caplog):
    from test_loop import DENSE, tiny_recipe

    from veomni.train.recipe import recipe_from_dict, save_recipe

    # A healthy run saves step 2; resumed at lr 1e30 (taken: optim.on_resume=recipe) it diverges after it; the
    # resume the message advises (a lower lr, optim.on_resume=recipe) then trains past that step.
    raw = tiny_recipe(str(tmp_path / "run"), DENSE, steps=2, tokens_per_step=256, tokens_per_micro_batch=256)
    raw["optim"].update({"lr": 1e-3, "warmup_steps": 0, "max_grad_norm": None})
    raw["checkpoint"].update({"save_final": True, "resume": "auto"})
    path = save_recipe(recipe_from_dict(raw), tmp_path / "run.yaml")
    assert main([str(path)]) == 0, capsys.readouterr().err[-2000:]
    capsys.readouterr()

    assert main([str(path), "--train.steps=4", "--optim.lr=1e30", "--optim.on_resume=recipe"]) == 1
    err = capsys.readouterr().err
    assert "TrainingDivergedError: step " in err and "Traceback" not in err
    assert "step_00000002" in err and "lower --optim.lr and --optim.on_resume=recipe" in err

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="veomni"):
        code = main([str(path), "--train.steps=4", "--optim.lr=1e-4", "--optim.on_resume=recipe"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "done: 2 steps" in capsys.readouterr().out
    assert (
        "with the recipe's optimizer values (optim.on_resume=recipe): ['optim.lr: saved 0.001, recipe 0.0001']"
        in caplog.text
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and not r.get("diverged")][-2:] == [3, 4]


@pytest.mark.parametrize("name", builtin_recipes())
def test_a_recipe_reading_downloaded_weights_says_how_to_download_them(name):
    # The recipes' comments are the first thing a user copies: `hf download` (huggingface_hub's current CLI), into
    # the directory model.weights reads, or into one the comments then convert into it.
    text = (RECIPES_DIR / f"{name}.yaml").read_text()
    weights = yaml.safe_load(text)["model"].get("weights")
    if not (isinstance(weights, str) and weights.startswith("checkpoints/")):
        return
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "huggingface-cli" not in comments
    downloads = re.findall(r"^#\s+hf download [\w.-]+/[\w.-]+ --local-dir (\S+)$", comments, re.MULTILINE)
    assert downloads, f"{name}: no '#   hf download ORG/NAME --local-dir DIR' line"
    assert any(weights == d or weights.startswith(d + "/") for d in downloads) or weights in comments, (
        name, weights, downloads,
    )  # fmt: skip
