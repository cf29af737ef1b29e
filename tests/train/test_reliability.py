"""Issue 14: nothing the trainer does with a bad recipe, bad data or a foreign checkpoint happens silently.

Each test asserts that the error names what was expected and what was found; checks that need no model are
shown to fail before the model is built (`build_recipe_model` is wrapped to record a call, nothing else changes).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import yaml
from data_helpers import WORDS, chat, write_jsonl
from test_loop import DENSE, tiny_recipe

from veomni.train.recipe import RecipeError, load_recipe, recipe_from_dict, recipe_to_dict

# --- data -------------------------------------------------------------------------------------------------------

LONG = " ".join(WORDS[:12])


def trained_rows(n: int) -> list[dict]:
    """Conversations longer than 64 tokens: truncated to data.max_seq_len=64, each fills a micro-batch alone and
    keeps trained assistant tokens."""
    return [chat(LONG, " ".join(WORDS[i % 5 : i % 5 + 8])) for i in range(n)]


def masked_rows(n: int) -> list[dict]:
    """User-only conversations: with assistant_only_loss no token is trained."""
    return [chat(f"{LONG} {WORDS[i]}") for i in range(n)]


def small_batches(raw: dict, files: list[Path], steps: int) -> dict:
    """One 64-token row per micro-batch, one micro-batch per step, in file order."""
    raw["data"].update(
        {"train_files": [str(f) for f in files], "shuffle": False, "max_seq_len": 64, "overlong": "truncate"}
    )
    raw["train"].update({"tokens_per_step": 64, "tokens_per_micro_batch": 64, "steps": steps})
    return raw


def with_model(model: dict, **changes) -> dict:
    return {**copy.deepcopy(model), **changes}


# --- rank tasks (module level: shipped to the pool by reference) ------------------------------------------------


def _build_watched(ctx, raw: dict) -> tuple[str | None, str, bool]:
    """build_run; returns (error type, error text, whether the model was built)."""
    from veomni.train import loop

    built = []
    real = loop.build_recipe_model

    def watched(*args, **kwargs):
        built.append(True)
        return real(*args, **kwargs)

    loop.build_recipe_model = watched
    try:
        loop.build_run(recipe_from_dict(raw))
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err), bool(built)
    finally:
        loop.build_recipe_model = real
    return None, "", bool(built)


def _train(ctx, raw: dict) -> dict:
    from veomni.train.loop import train

    return train(recipe_from_dict(raw))


def _train_refused(ctx, raw: dict) -> tuple[str, str]:
    from veomni.train.loop import train

    try:
        train(recipe_from_dict(raw))
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err)
    raise AssertionError("train() accepted the checkpoint")


def _load_into(ctx, raw: dict, path: str) -> tuple[str, bool, bool]:
    """A fresh run of ``raw`` asks its CheckpointManager to load ``path`` (past the config comparison): returns
    the error text and whether any parameter or the step count changed."""
    from veomni.train.loop import build_run

    fresh = copy.deepcopy(raw)
    # A directory of its own: a fresh run sets aside the step directories of the one it starts in.
    fresh["checkpoint"].update({"resume": "never", "dir": str(Path(path).parent / "fresh_run")})
    run = build_run(recipe_from_dict(fresh))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    with pytest.raises(Exception) as info:
        run.checkpoints.load(path, run.model, run.optimizer)
    changed = any(not torch.equal(p.detach(), before[n]) for n, p in run.model.named_parameters())
    return f"{type(info.value).__name__}: {info.value}", changed, bool(run.optimizer.state)


def _tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.detach().clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def _step_by_step(ctx, raw: dict) -> list[dict]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    out = []
    for _ in range(run.total_steps):
        step = next(it)
        params = [p.detach().clone() for p in run.model.parameters()]
        state = _tensors(run.optimizer)
        epoch = run.scheduler.last_epoch
        stats = train_step(run, step)
        new_state = _tensors(run.optimizer)
        out.append({
            "valid_tokens": step.valid_tokens,
            "stats": stats,
            "params_changed": any(not torch.equal(a, b.detach()) for a, b in zip(params, run.model.parameters(), strict=True)),
            "optimizer_changed": len(state) != len(new_state)
            or any(not torch.equal(a, b) for a, b in zip(state, new_state, strict=True)),
            "schedule_stepped": run.scheduler.last_epoch != epoch,
            "skipped_steps": run.skipped_steps,
        })  # fmt: skip
    return out


# --- item 1: a checkpoint of another model is refused -----------------------------------------------------------


def test_resume_of_a_deeper_checkpoint_is_refused(dist_pools, tmp_path):
    pool = dist_pools.get(1, "gloo")
    four = tiny_recipe(str(tmp_path), with_model(DENSE, num_hidden_layers=4), steps=1)
    four["checkpoint"]["save_final"] = True
    pool.run(_train, four)
    saved = tmp_path / "step_00000001"
    assert (saved / "COMPLETE").is_file()

    two = tiny_recipe(str(tmp_path), DENSE, steps=2)
    two["checkpoint"]["resume"] = "auto"
    kind, message = pool.run(_train_refused, two)[0]
    assert kind == "CheckpointMismatchError"
    assert f"checkpoint {saved} was saved by another model" in message
    assert "num_hidden_layers: saved 4, now 2" in message
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1] and not any("resumed_from" in r for r in lines)

    # Past the config comparison (an older checkpoint without one), the tensors are compared before any is read.
    message, changed, _ = pool.run(_load_into, two, str(saved))[0]
    assert message.startswith("CheckpointMismatchError")
    assert "does not hold this run's model" in message
    assert "the checkpoint holds 22 model tensors this run does not: model.model.layers.2." in message
    assert not changed


# --- item 2: typo'd model.config keys ---------------------------------------------------------------------------


def test_typo_in_inline_model_config_is_refused_with_did_you_mean(tmp_path):
    data = recipe_to_dict(recipe_from_dict(tiny_recipe(str(tmp_path), DENSE)))
    data["model"]["config"]["num_hiden_layers"] = 3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "'num_hiden_layers' is not a key of Qwen3Config; did you mean 'num_hidden_layers'?" in str(
        info.value
    )

    del data["model"]["config"]["num_hiden_layers"]
    path.write_text(yaml.safe_dump(data))
    assert load_recipe(path).model.config["num_hidden_layers"] == 2
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["--model.config.rope_thetta=1e4"])
    message = str(info.value)
    assert "model.config" in message and "'rope_thetta' is not a key of Qwen3Config" in message
    assert "did you mean" in message


def test_typo_in_build_model_config_overrides_is_refused():
    from transformers import AutoConfig

    from veomni.kernels import OpsConfig
    from veomni.models.build import build_model

    values = dict(DENSE)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with pytest.raises(ValueError) as info:
        build_model(config, ops=OpsConfig(), config_overrides={"num_hiden_layers": 1}, device="cpu")
    assert "'num_hiden_layers' is not a key of Qwen3Config; did you mean 'num_hidden_layers'?" in str(
        info.value
    )


# --- item 3: data without trained tokens ------------------------------------------------------------------------


def test_all_masked_data_is_an_error_before_the_model_is_built(dist_pools, tmp_path):
    masked = write_jsonl(tmp_path / "user_only.jsonl", masked_rows(6))
    raw = small_batches(tiny_recipe(str(tmp_path / "run"), DENSE), [masked], steps=2)
    kind, message, built = dist_pools.get(1, "gloo").run(_build_watched, raw)[0]
    assert kind == "DataError"
    assert f"data.train_files: no trained token in ['{masked}']" in message
    assert "6 rows" in message and "every label masked" in message
    assert not built


def test_a_step_without_trained_tokens_is_skipped(dist_pools, tmp_path):
    files = [
        write_jsonl(tmp_path / "a.jsonl", trained_rows(2)),
        write_jsonl(tmp_path / "user_only.jsonl", masked_rows(1)),
        write_jsonl(tmp_path / "b.jsonl", trained_rows(2)),
    ]
    raw = small_batches(tiny_recipe(str(tmp_path / "steps"), DENSE), files, steps=4)
    pool = dist_pools.get(1, "gloo")
    steps = pool.run(_step_by_step, raw)[0]
    assert [s["valid_tokens"] == 0 for s in steps] == [False, False, True, False]
    for i, s in enumerate(steps):
        if i == 2:
            assert s["stats"]["skipped"] == 1.0 and math.isnan(s["stats"]["loss"])
            assert not s["params_changed"] and not s["optimizer_changed"] and not s["schedule_stepped"]
        else:
            assert s["stats"]["skipped"] == 0.0 and math.isfinite(s["stats"]["loss"])
            assert s["params_changed"] and s["optimizer_changed"] and s["schedule_stepped"]
    assert [s["skipped_steps"] for s in steps] == [0, 0, 1, 1]
    # The step after the skipped one trains with the learning rate the skipped one would have had.
    assert steps[3]["stats"]["lr"] == steps[2]["stats"]["lr"] != steps[1]["stats"]["lr"]

    raw["checkpoint"]["dir"] = str(tmp_path / "job")
    history = pool.run(_train, raw)[0]
    assert history["skipped"] == [3] and all(math.isfinite(x) for x in history["loss"])
    records = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["skipped"] == "no trained token" and "loss" not in records[2]
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)


def test_empty_and_masked_files_beside_trained_ones_are_named_in_a_warning(tmp_path, caplog):
    from data_helpers import tokenizer

    from veomni.train.data.build import check_trained_tokens, encoder_for, index_files

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    files = [
        str(empty),
        str(write_jsonl(tmp_path / "good.jsonl", trained_rows(3))),
        str(write_jsonl(tmp_path / "user_only.jsonl", masked_rows(2))),
    ]
    section = recipe_from_dict(
        small_batches(tiny_recipe(str(tmp_path), DENSE), [Path(f) for f in files], 2)
    ).data
    source, index = index_files(section, files, encoder_for(section, tokenizer()))
    with caplog.at_level(logging.WARNING, logger="veomni.train.data.build"):
        check_trained_tokens(source, index, files, "data.train_files")
    # check_trained_tokens' own warnings (indexing also warns, about the truncated rows).
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.getMessage().startswith("data.train_files: ")
    ]
    assert f"data.train_files: {empty} holds no row" in warnings
    assert f"data.train_files: {files[2]} holds 2 rows but no trained token (every label masked)" in warnings
    assert len(warnings) == 2


# --- items 4 and 6: checks before the model build ---------------------------------------------------------------


def test_vocab_smaller_than_the_tokenizer_is_an_error_before_the_build(dist_pools, tmp_path):
    raw = tiny_recipe(str(tmp_path), with_model(DENSE, vocab_size=512))
    kind, message, built = dist_pools.get(1, "gloo").run(_build_watched, raw)[0]
    assert kind == "PreflightError" and not built
    assert "has 1024 tokens (ids up to 1023) but the model's vocab_size is 512" in message
    assert "quickstart/tokenizer" in message


def test_warmup_longer_than_the_run_is_an_error_before_the_build(dist_pools, tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE, steps=3)
    raw["optim"]["warmup_steps"] = 5
    kind, message, built = dist_pools.get(1, "gloo").run(_build_watched, raw)[0]
    assert kind == "PreflightError" and not built
    assert "optim.warmup_steps=5 is longer than the run (3 steps)" in message


def test_sp_head_layout_is_checked_before_the_build(dist_pools, tmp_path):
    from transformers import AutoConfig

    from veomni.train.preflight import PreflightError, check_sp_heads

    values = with_model(DENSE, num_attention_heads=3, num_key_value_heads=3)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    check_sp_heads(config, 1)
    check_sp_heads(config, 3)
    with pytest.raises(PreflightError) as info:
        check_sp_heads(config, 2)
    assert "parallel.sp=2 does not fit the model (Qwen3Config)" in str(info.value)

    raw = tiny_recipe(str(tmp_path), with_model(DENSE, num_attention_heads=3, num_key_value_heads=3), sp=2)
    results = dist_pools.get(2, "gloo").run(_build_watched, raw)
    for kind, message, built in results:
        assert kind == "PreflightError" and not built
        assert "parallel.sp=2 does not fit the model" in message


# --- item 5: an untied lm_head is a model mismatch --------------------------------------------------------------


def test_resume_into_a_new_untied_lm_head_is_a_model_mismatch(dist_pools, tmp_path):
    pool = dist_pools.get(1, "gloo")
    tied = tiny_recipe(str(tmp_path), with_model(DENSE, tie_word_embeddings=True), steps=1)
    tied["checkpoint"]["save_final"] = True
    pool.run(_train, tied)
    untied = tiny_recipe(str(tmp_path), with_model(DENSE, tie_word_embeddings=False), steps=2)
    untied["checkpoint"]["resume"] = "auto"
    kind, message = pool.run(_train_refused, untied)[0]
    assert kind == "CheckpointMismatchError"
    assert "tie_word_embeddings: saved True, now False" in message

    message, changed, _ = pool.run(_load_into, untied, str(tmp_path / "step_00000001"))[0]
    assert "does not hold this run's model" in message and "optimizer" not in message.split("\n")[1]
    assert "trained parameters of their own in this run but were not in the checkpoint's run" in message
    assert "model.lm_head.weight" in message
    assert not changed


# --- item 6: the resumed_from marker ----------------------------------------------------------------------------


def test_metrics_mark_where_a_resumed_run_continues(dist_pools, tmp_path):
    pool = dist_pools.get(1, "gloo")
    raw = tiny_recipe(str(tmp_path), DENSE, steps=3)
    raw["checkpoint"]["interval"] = 2
    pool.run(_train, raw)
    raw["checkpoint"]["resume"] = "auto"
    history = pool.run(_train, raw)[0]
    assert len(history["loss"]) == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 2, 3]
    assert records[3] == {"resumed_from": str(tmp_path / "step_00000002"), "step": 2}


def _report_window(ctx, window: list) -> tuple[list[str], list[dict]]:
    from types import SimpleNamespace

    from veomni.train.metrics import Sinks
    from veomni.train.run_log import log_window

    class Recorded(Sinks):  # the real (unconfigured) sinks, recording what they are handed
        def __init__(self):
            super().__init__(tensorboard_dir=None, wandb_project=None, run_name="t", config={})
            self.written: list[dict] = []

        def write(self, step: int, values: dict[str, float]) -> None:
            self.written.append({"step": step, **values})

    class Lines(list):  # a progress bar's write(), as tqdm's
        write = list.append

    run = SimpleNamespace(
        step=2, total_steps=4, device=torch.device("cpu"), recipe=SimpleNamespace(log=SimpleNamespace(console=True)),
        state=SimpleNamespace(dims=SimpleNamespace(world_size=1)), expert_layers=[], task=SimpleNamespace(),
    )  # fmt: skip
    sinks, lines = Recorded(), Lines()
    log_window(run, window, None, sinks, lines)
    return list(lines), sinks.written


def test_a_diverged_step_is_reported_as_nan_not_as_a_skipped_one(dist_pools):
    # Step 2 trained and its loss came back NaN (diverged): the window's line and the sinks must show it. Before,
    # the window told skipped steps by a NaN loss, so this step read "skipped 1 (no trained token)" and the
    # dashboards got nothing for it.
    ok = ({"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3}, 0.5, 0.0, 100, 0.0, False)
    diverged = ({"loss": math.nan, "grad_norm": math.nan, "lr": 1e-3}, 0.5, 0.0, 100, 0.0, False)
    lines, written = dist_pools.get(1, "gloo").run(_report_window, [diverged])[0]
    assert len(lines) == 1 and "loss nan" in lines[0] and "skipped" not in lines[0]
    assert len(written) == 1 and math.isnan(written[0]["loss"]) and math.isnan(written[0]["grad_norm"])
    skipped = ({"loss": math.nan, "grad_norm": math.nan, "lr": 1e-3}, 0.5, 0.0, 100, 0.0, True)
    lines, written = dist_pools.get(1, "gloo").run(_report_window, [ok, skipped])[0]
    assert "loss 2.0000" in lines[0] and "skipped 1 (no trained token or fp16 overflow)" in lines[0]
    assert [w["loss"] for w in written] == [2.0]


def _train_with_a_slow_export(ctx, raw: dict, seconds: float) -> dict:
    """`_train` where each HF export takes ``seconds`` longer (a large model's export, on a tiny one)."""
    import time

    from veomni.models.export import hf as export

    real = export.export_hf

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    export.export_hf = slow
    try:
        return _train(ctx, raw)
    finally:
        export.export_hf = real


def test_interval_exports_are_not_counted_as_step_time(dist_pools, tmp_path):
    # Like evaluations and checkpoints, an HF export between steps is not training: its time must not lower the
    # window's tokens/s and MFU (the steps before it were left unread and took the export's seconds).
    raw = tiny_recipe(str(tmp_path), DENSE, steps=3, log_interval=3)
    raw["checkpoint"]["hf_export_interval"] = 2
    history = dist_pools.get(1, "gloo").run(_train_with_a_slow_export, raw, 3.0)[0]
    assert len(history["exports"]) == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seconds = {r["step"]: r["seconds"] for r in records}
    assert sorted(seconds) == [1, 2, 3]
    assert max(seconds.values()) < 1.0, seconds  # a step takes ~0.2 s here; the export 3 s more


def test_a_rolled_back_run_sets_newer_checkpoints_aside(dist_pools, tmp_path):
    # Run A saves steps 3 and 6. Run B resumes from step 3 and saves step 5 at its end. Before, A's step 6 stayed a
    # step directory: keep-last-2 pruning deleted B's step 3 and kept A's 6, and resume=auto then continued A's
    # abandoned line instead of B's newest state.
    from veomni.train.checkpoint import latest_complete

    pool = dist_pools.get(1, "gloo")
    raw = tiny_recipe(str(tmp_path), DENSE, steps=6)
    raw["checkpoint"].update({"interval": 3, "keep_last": 2})
    pool.run(_train, raw)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000006"]
    # A's save of step 7 killed midway: set aside with the rest of A's line, then pruned by B's first complete
    # save (it never was loadable); A's complete step 6 is kept.
    (tmp_path / "step_00000007" / "dcp").mkdir(parents=True)
    rolled = copy.deepcopy(raw)
    rolled["train"]["steps"] = 5
    rolled["checkpoint"].update({"resume": str(tmp_path / "step_00000003"), "save_final": True})
    pool.run(_train, rolled)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000003",
        "step_00000005",
        "step_00000006.abandoned",
    ]
    assert latest_complete(tmp_path) == tmp_path / "step_00000005"
    # A fresh start in the used directory sets everything aside, and its metrics supersede all earlier lines.
    fresh = copy.deepcopy(raw)
    fresh["train"]["steps"] = 1
    pool.run(_train, fresh)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000003.abandoned",
        "step_00000005.abandoned",
        "step_00000006.abandoned",
    ]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-2] == {"resumed_from": None, "step": 0} and records[-1]["step"] == 1


def test_an_epochs_run_resumed_with_another_step_size_is_refused(dist_pools, tmp_path):
    # train.epochs is turned into a step count of the current step size, from step 0, while the resumed step counts
    # the saved run's steps: with another step size the run ended before (or after) its last epoch.
    files = [write_jsonl(tmp_path / "a.jsonl", trained_rows(8))]
    raw = small_batches(tiny_recipe(str(tmp_path / "job"), DENSE), files, steps=None)
    raw["train"].update({"epochs": 1, "tokens_per_step": 128})
    raw["checkpoint"]["interval"] = 2
    pool = dist_pools.get(1, "gloo")
    pool.run(_train, raw)
    raw["train"]["tokens_per_step"] = 64
    raw["checkpoint"]["resume"] = str(tmp_path / "job" / "step_00000002")
    kind, message = pool.run(_train_refused, raw)[0]
    assert kind == "PreflightError"
    assert "train.epochs=1 with 1 micro-batches per step" in message and "took 2" in message
