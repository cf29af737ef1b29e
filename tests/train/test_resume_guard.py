"""Resume refuses every structural model change and accepts a pure world-size change (issue 14).

The property test drives the two pure checks a resume runs before reading any tensor: `config_diff` (saved model
config vs the run's) and `check_payload_matches` (the checkpoint's DCP metadata vs the run's model + optimizer
payload). Checkpoints are real DCP writes of tiny CPU models with one AdamW step of state, cached per config, so
hundreds of examples cost seconds. The full loop's world-size change (2 ranks -> 1) is
``test_loop.test_resume_on_another_world_size_continues_the_same_run``; here one 1 -> 2 rank resume runs through
`build_run`.
"""

from __future__ import annotations

import atexit
import copy
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import DENSE, _train_and_save, tiny_recipe

from veomni.train.checkpoint.match import CheckpointMismatchError, check_payload_matches, config_diff
from veomni.train.recipe import recipe_from_dict

# A structure: (moe, layers, hidden, tied, experts); experts only matters for MoE.
Structure = tuple[bool, int, int, bool, int]


def config_of(structure: Structure):
    from transformers import AutoConfig

    moe, layers, hidden, tied, experts = structure
    values = {
        "vocab_size": 128, "hidden_size": hidden, "intermediate_size": 48, "num_hidden_layers": layers,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }  # fmt: skip
    if moe:
        values.update({"num_experts": experts, "num_experts_per_tok": 1, "moe_intermediate_size": 16})
    return AutoConfig.for_model("qwen3_moe" if moe else "qwen3", **values)


@functools.cache
def payload_of(structure: Structure) -> dict:
    """The DCP payload a run of ``structure`` saves and loads: model and AdamW state after one step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(structure))
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


@functools.cache
def _root() -> Path:
    # Cached across hypothesis examples (a fixture's tmp_path would be per test call); removed at exit.
    path = Path(tempfile.mkdtemp(prefix="veomni-resume-guard-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def checkpoint_of(structure: Structure) -> Path:
    """A real DCP checkpoint of ``structure`` (written once per structure and test session)."""
    import torch.distributed.checkpoint as dcp

    path = _root() / "_".join(str(int(v)) for v in structure) / "dcp"
    dcp.save(payload_of(structure), checkpoint_id=path)
    return path


@st.composite
def structures(draw: st.DrawFn) -> Structure:
    moe = draw(st.booleans())
    return (
        moe,
        draw(st.integers(1, 2)),
        draw(st.sampled_from([16, 32])),
        draw(st.booleans()),
        draw(st.sampled_from([2, 4])) if moe else 0,
    )


@st.composite
def pairs(draw: st.DrawFn) -> tuple[Structure, Structure]:
    """A saved structure and the resuming run's: the same one, or the saved one with some fields changed."""
    saved = draw(structures())
    changed = draw(st.sets(st.sampled_from(range(5)), max_size=3))
    now = list(saved)
    other = draw(structures())
    for i in changed:
        now[i] = other[i]
    if not now[0]:
        now[4] = 0
    elif not now[4]:
        now[4] = draw(st.sampled_from([2, 4]))
    return saved, tuple(now)


@settings(max_examples=60)
@given(pair=pairs())
def test_resume_refuses_every_structural_change(pair):
    saved, now = pair
    diff = config_diff(config_of(saved).to_dict(), config_of(now).to_dict())
    if saved == now:
        assert diff == []
        check_payload_matches(checkpoint_of(saved), payload_of(now))
        return
    assert diff, (saved, now)
    for line in diff:
        assert (
            ": saved " in line
            or "not in the checkpoint's config" in line
            or "not in the current config" in line
        )
    with pytest.raises(CheckpointMismatchError) as info:
        check_payload_matches(checkpoint_of(saved), payload_of(now))
    message = str(info.value)
    # Always reported as the model's difference, never as a missing optimizer key.
    assert "does not hold this run's model" in message, message
    if saved[1] > now[1] and saved[0] == now[0]:
        assert f"model.model.layers.{now[1]}." in message
    if saved[1:] == now[1:] and saved[0] == now[0] and saved[3] != now[3]:
        assert "model.lm_head.weight" in message


def test_config_diff_ignores_runtime_entries_and_names_nested_ones():
    a = config_of((False, 1, 16, False, 0)).to_dict()
    b = copy.deepcopy(a)
    b.update({"dtype": "bfloat16", "use_cache": False, "_name_or_path": "/elsewhere"})
    assert config_diff(a, b) == []
    b["rope_parameters"] = {**a["rope_parameters"], "rope_theta": 1.0}
    assert config_diff(a, b) == [
        f"rope_parameters.rope_theta: saved {a['rope_parameters']['rope_theta']!r}, now 1.0"
    ]


def _resume_step(ctx, raw: dict) -> int:
    from veomni.train.loop import build_run

    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    run = build_run(recipe_from_dict(resumed))
    assert run.resumed_from is not None
    return run.step


def test_resume_on_more_ranks_is_accepted(dist_pools, tmp_path):
    # Saved on one rank (a plain module), resumed on two (FSDP shards): same global shapes, so it loads.
    raw = tiny_recipe(str(tmp_path), DENSE)
    dist_pools.get(1, "gloo").run(_train_and_save, raw, 1)
    assert dist_pools.get(2, "gloo").run(_resume_step, raw) == [1, 1]


def _resumed_hyperparameters(ctx, raw: dict, overrides: dict) -> list[dict]:
    from veomni.train.loop import build_run

    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    resumed["optim"].update(overrides)
    run = build_run(recipe_from_dict(resumed))
    factor = run.scheduler.lr_lambdas[0](run.scheduler.last_epoch)
    return [
        {k: g[k] for k in ("lr", "initial_lr", "betas", "eps", "weight_decay", "lr_multiplier")} | {"f": factor}
        for g in run.optimizer.param_groups
    ]


def test_a_resume_takes_the_recipes_lr_only_when_asked(dist_pools, tmp_path):
    # What the divergence message advises: resume with a lower optim.lr. By default the checkpoint's values stay
    # (the exact continuation); optim.on_resume=recipe puts the new ones on every group, multipliers kept.
    raw = tiny_recipe(str(tmp_path), DENSE, steps=4)
    raw["optim"].update({"lr": 1e-3, "weight_decay": 0.1, "lr_multipliers": {"model.embed_tokens": 0.5}})
    pool = dist_pools.get(1, "gloo")
    pool.run(_train_and_save, raw, 2)
    lower = {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.01}
    kept = pool.run(_resumed_hyperparameters, raw, lower)[0]
    taken = pool.run(_resumed_hyperparameters, raw, {**lower, "on_resume": "recipe"})[0]
    for group in kept:
        assert group["initial_lr"] == pytest.approx(1e-3 * group["lr_multiplier"])
        assert tuple(group["betas"]) == (0.9, 0.95) and group["eps"] == 1e-8
    for group in taken:
        assert group["initial_lr"] == pytest.approx(1e-4 * group["lr_multiplier"])
        assert group["lr"] == pytest.approx(1e-4 * group["lr_multiplier"] * group["f"])
        assert tuple(group["betas"]) == (0.8, 0.9) and group["eps"] == 1e-6
        assert group["weight_decay"] in (0.0, 0.01)
    assert {g["lr_multiplier"] for g in taken} == {0.5, 1.0}
    assert any(g["weight_decay"] == 0.01 for g in taken) and any(g["weight_decay"] == 0.0 for g in taken)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_checkpoint_saved_before_the_first_step_resumes_exactly(dist_pools, tmp_path, model):
    # Saved at step 0: no parameter has AdamW state yet, and none is saved or invented on load (issue 42).
    from resume_helpers import check_exact_resume, resume_before_gradients
    from test_loop import MOE

    raw = tiny_recipe(str(tmp_path), DENSE if model == "dense" else MOE, steps=2)
    result = dist_pools.get(1, "gloo").run(resume_before_gradients, raw, 0, 2)[0]
    check_exact_resume(result, some="embed_tokens")


def test_a_checkpoint_without_state_for_some_parameters_is_accepted():
    # Two of the structure's parameters never had a gradient: the match reads the trained parameters from the
    # optimizer's groups and reports those two, instead of refusing them as tied or frozen.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM

    structure = (False, 1, 16, False, 0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(structure))
    optimizer = torch.optim.AdamW(model.parameters())
    untouched = {"lm_head.weight", "model.norm.weight"}
    for name, p in model.named_parameters():
        p.grad = None if name in untouched else torch.zeros_like(p)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    path = _root() / "partial" / "dcp"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    assert check_payload_matches(path, payload_of(structure)) == sorted(untouched)


def _resume_keeping_logs(ctx, raw: dict) -> tuple[int, dict[str, float], list[str]]:
    import logging

    from test_loop import _resume_and_step

    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger("veomni.train"), logging.getLogger("veomni.models.build")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    try:
        step, stats = _resume_and_step(ctx, raw)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    return step, stats, messages


def test_a_resume_does_not_read_model_weights(dist_pools, tmp_path):
    # Every parameter comes from the checkpoint, so model.weights is not read at all (issue 42: at 100B+ it took
    # minutes to load weights that were then overwritten). Corrupted after the save, it cannot be loaded: the
    # resume works and continues the straight run exactly.
    from test_loop import _steps, initial_weights

    weights = Path(initial_weights(DENSE, str(tmp_path / "weights")))
    raw = tiny_recipe(str(tmp_path / "run"), DENSE, weights=str(weights), steps=2)
    pool = dist_pools.get(1, "gloo")
    straight = pool.run(_steps, raw, 2)[0]
    pool.run(_train_and_save, raw, 1)
    (file,) = weights.glob("*.safetensors")
    file.write_bytes(b"not a safetensors file")
    step, stats, messages = pool.run(_resume_keeping_logs, raw)[0]
    assert step == 1
    assert stats["loss"] == straight[1]["loss"]
    assert any("model weights are taken from the checkpoint" in m for m in messages), messages
