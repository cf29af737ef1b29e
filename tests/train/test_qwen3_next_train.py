"""Qwen3-Next in the text trainer on real gloo ranks: the (dp, sp, ep) grid gives the single-process loss and grad
norm per step (Gated DeltaNet under Ulysses SP over heads, experts under EP, packed rows throughout), and a DCP
checkpoint resumes and exports to a plain-transformers checkpoint.

On CPU the Gated DeltaNet ops default to the eager oracles (fla is CUDA-only); transformers is only used to write
the initial weights and to read the export.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_loop import initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 2
# 2 linear-attention layers + 1 full-attention layer (full_attention_interval 3); 4 key / 8 value heads so SP=2
# splits them; layer 0 dense, then routed + shared experts. Widths are multiples of 4 (the 'torch' grouped GEMM).
QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "full_attention_interval": 3, "mlp_only_layers": [0], "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.25, "linear_num_key_heads": 4,
    "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}  # fmt: skip
LAYOUTS = [(1, 2, 1), (1, 1, 2), (1, 2, 2)]  # (dp_replicate, sp, ep) on 2 ranks; dp_shard fills the rest


def _recipe(tmp: str, weights: str, *, sp: int = 1, ep: int = 1, **train) -> dict:
    raw = tiny_recipe(tmp, QWEN3_NEXT, weights=weights, sp=sp, ep=ep, steps=STEPS, **train)
    raw["ops"] = {"moe_experts": "torch"}
    return raw


def _steps(ctx, raw: dict) -> list[dict[str, float]]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def setup(dist_pools, tmp_path_factory):
    weights = initial_weights(QWEN3_NEXT, str(tmp_path_factory.mktemp("q3n_init")))
    raw = _recipe(str(tmp_path_factory.mktemp("q3n_ref")), weights)
    return weights, dist_pools.get(1, "gloo").run(_steps, raw)[0]


def test_every_layout_matches_one_process(dist_pools, setup, tmp_path):
    weights, reference = setup
    pool = dist_pools.get(2, "gloo")
    for dp_replicate, sp, ep in LAYOUTS:
        raw = _recipe(str(tmp_path / f"{dp_replicate}{sp}{ep}"), weights, sp=sp, ep=ep)
        for stats in pool.run(_steps, raw):
            layout = f"dp_replicate={dp_replicate} sp={sp} ep={ep}"
            for got, want in zip(stats, reference, strict=True):
                assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), layout
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), layout


def _save(ctx, raw: dict) -> dict[str, float]:
    from veomni.train.loop import _save, build_run, train_step

    run = build_run(recipe_from_dict(raw))
    stats = train_step(run, next(iter(run.train_data)))
    _save(run)
    return stats


def _resume_and_export(ctx, raw: dict) -> int:
    from veomni.train.loop import _export, build_run

    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    run = build_run(recipe_from_dict(resumed))
    _export(run, "hf")
    return run.step


def test_resume_and_export_under_sp_and_ep(dist_pools, setup, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights, _ = setup
    raw = _recipe(str(tmp_path / "ckpt"), weights, sp=2, ep=2)
    pool = dist_pools.get(2, "gloo")
    pool.run(_save, raw)
    assert pool.run(_resume_and_export, raw) == [1, 1]
    exported = load_file(tmp_path / "ckpt" / "hf" / "model.safetensors")
    source = load_file(f"{weights}/model.safetensors")
    assert set(exported) == set(source)  # per-expert keys again, nothing missing or extra
    changed = [k for k in source if not torch.equal(exported[k], source[k])]
    assert (
        "model.layers.0.linear_attn.A_log" in changed
        and "model.layers.1.mlp.experts.3.up_proj.weight" in changed
    )
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf")
    assert type(plain).__name__ == "Qwen3NextForCausalLM"
