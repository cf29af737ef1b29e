"""The dpo task through the trainer: the reference starts equal to the policy (loss log 2), the loss falls, and
Ulysses SP and data parallelism give one process's losses (gloo, CPU); LoRA's reference is the adapter-free base;
what preference training refuses, it refuses before building anything."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from veomni.train.preflight import PreflightError
from veomni.train.recipe import ASSETS_DIR, RecipeError, recipe_from_dict

PAIRS = ASSETS_DIR / "quickstart" / "pairs.jsonl"
TOKENIZER = ASSETS_DIR / "quickstart" / "tokenizer"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny Qwen3 checkpoint on disk (the policy's start and the reference)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("base")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


INLINE_CONFIG = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip


def dpo_recipe(weights: str | None, ckpt: str, **sections) -> dict:
    """A 3-step dpo recipe on the bundled pairs; without ``weights`` the model is `INLINE_CONFIG` at random."""
    raw = {
        "model": {"weights": weights, "tokenizer": str(TOKENIZER), "task": "dpo", "dtype": "float32",
                  **({} if weights else {"config": INLINE_CONFIG})},
        "data": {"train_files": [str(PAIRS)], "kind": "preference", "max_seq_len": 256, "num_workers": 0,
                 "shuffle": False},
        "train": {"tokens_per_step": 2048, "tokens_per_micro_batch": 1024, "steps": 3, "epochs": None,
                  "seed": 0, "device": "cpu", "log_interval": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"dir": ckpt, "resume": "never", "hf_export": False, "save_final": False},
    }  # fmt: skip
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def _steps(ctx, raw: dict, n: int) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict as load

    run = build_run(load(raw))
    it = iter(run.train_data)
    stats = [train_step(run, next(it)) for _ in range(n)]
    return {"losses": [s["loss"] for s in stats], "margins": [s["rewards/margin"] for s in stats]}


@pytest.fixture(scope="module")
def one_rank(dist_pools, base, tmp_path_factory) -> dict:
    raw = dpo_recipe(base, str(tmp_path_factory.mktemp("one")))
    return dist_pools.get(1, "gloo").run(_steps, raw, 3)[0]


def test_the_reference_starts_at_the_policy_and_the_loss_falls(one_rank):
    losses = one_rank["losses"]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference: every log-ratio is 0
    assert one_rank["margins"][0] == pytest.approx(0.0, abs=1e-6)
    assert losses[-1] < losses[0] and one_rank["margins"][-1] > 0, one_rank


@pytest.mark.parametrize("parallel", [{"sp": 2}, {"dp_shard": 2}], ids=["sp2", "dp2"])
def test_two_ranks_match_one(dist_pools, base, one_rank, tmp_path, parallel):
    raw = dpo_recipe(base, str(tmp_path / "run"), parallel=parallel)
    for got in dist_pools.get(2, "gloo").run(_steps, copy.deepcopy(raw), 3):
        assert got["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-5), (got, one_rank)
        assert got["margins"] == pytest.approx(one_rank["margins"], rel=1e-3, abs=1e-5), (got, one_rank)


def test_lora_reference_is_the_base_with_adapters_off(dist_pools, base, tmp_path):
    raw = dpo_recipe(base, str(tmp_path / "run"), lora={"enabled": True, "rank": 4, "alpha": 8})
    got = dist_pools.get(1, "gloo").run(_steps, raw, 3)[0]
    # B starts at 0: the adapted policy equals its base, the reference.
    assert got["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert got["losses"][-1] < got["losses"][0], got


def test_reference_free_losses_need_no_weights(dist_pools, tmp_path):
    raw = dpo_recipe(None, str(tmp_path / "run"), dpo={"loss": "simpo", "beta": 2.0})
    got = dist_pools.get(1, "gloo").run(_steps, raw, 2)[0]
    assert all(math.isfinite(x) for x in got["losses"]), got


def test_refusals(base, tmp_path):
    from veomni.train.tasks.preference import check_dpo_recipe

    with pytest.raises(RecipeError, match=r"dpo: \['dpo.beta'\] set, but model.task='text'"):
        raw = dpo_recipe(base, str(tmp_path), dpo={"beta": 0.5})
        raw["model"]["task"] = "text"
        recipe_from_dict(raw)
    with pytest.raises(RecipeError, match="dpo.gamma is SimPO's margin"):
        recipe_from_dict(dpo_recipe(base, str(tmp_path), dpo={"gamma": 1.0}))
    no_weights = recipe_from_dict(dpo_recipe(None, str(tmp_path)))
    with pytest.raises(PreflightError, match="model.weights for dpo.loss 'sigmoid'"):
        check_dpo_recipe(no_weights)
    text = dpo_recipe(base, str(tmp_path), data={"kind": "conversation"})
    with pytest.raises(PreflightError, match="data.kind preference"):
        check_dpo_recipe(recipe_from_dict(text))


@pytest.mark.slow
def test_quickstart_dpo_from_the_cli_logs_rewards_and_exports(base, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "veomni.train.cli", "quickstart_dpo", f"--model.weights={base}",
        f"--model.tokenizer={TOKENIZER}", f"--checkpoint.dir={out}", "--train.steps=6", "--train.log_interval=3",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "step 6/6" in line]
    assert lines and "margin " in lines[-1] and "accuracy " in lines[-1], done.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.model_type == "qwen3"


def test_evaluation_reports_pair_loss_accuracy_and_margin(dist_pools, base, tmp_path):
    """An eval pass over held-out pairs (here the first rows of the bundled ones) on two SP ranks equals one
    rank's: each pair counted once."""
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:24]))

    def recipe(parallel: dict) -> dict:
        return dpo_recipe(base, str(tmp_path / f"run{len(parallel)}"), data={"eval_files": [str(held_out)]},
                          train={"eval_interval": 2}, parallel=parallel)  # fmt: skip

    one = dist_pools.get(1, "gloo").run(_evaluate, recipe({}))[0]
    assert set(one) == {"eval_loss", "eval_rewards/accuracy", "eval_rewards/margin"}
    assert one["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)  # before training: policy == reference
    for got in dist_pools.get(2, "gloo").run(_evaluate, recipe({"sp": 2})):
        assert got == pytest.approx(one, rel=1e-5, abs=1e-6)


def _evaluate(ctx, raw: dict) -> dict:
    from veomni.train.loop import build_run
    from veomni.train.recipe import recipe_from_dict as load
    from veomni.train.step import evaluate

    return evaluate(build_run(load(raw)))
