"""DeepSeek-V3 in the text trainer on real gloo ranks: the (dp, sp, ep) layouts give the single-process loss and grad
norm per step (test_loop's grid, with MLA, group-limited routing and shared experts); the aux-loss-free router bias is
a buffer no step changes by default (transformers defines no update rule) that DCP checkpoints and the HF export carry
exactly, and with optim.moe_bias_update_speed it follows DeepSeek-V3's sign rule over the step's global load."""

from __future__ import annotations

import copy

import pytest
import torch
from test_loop import initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 2
# qk_nope 8 + qk_rope 8 = 16-wide keys, 12-wide values; 8 experts in 2 groups (1 kept, top-2), 1 shared expert,
# layer 0 dense. Widths are multiples of 4 (the 'torch' grouped GEMM's fp32 row alignment).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "routed_scaling_factor": 2.5, "rope_interleave": True, "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}  # fmt: skip
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
LAYOUTS = [(1, 2, 1), (1, 1, 2)]  # (dp_replicate, sp, ep) on 2 ranks; dp_shard fills the rest


def _recipe(tmp: str, weights: str, *, sp: int = 1, ep: int = 1, **train) -> dict:
    raw = tiny_recipe(tmp, DEEPSEEK_V3, weights=weights, sp=sp, ep=ep, steps=STEPS, **train)
    raw["ops"] = {"moe_experts": "torch"}
    return raw


def _bias(run) -> torch.Tensor:
    return dict(run.model.named_buffers())[BIAS].detach().cpu().clone()


def _steps(ctx, raw: dict) -> tuple[list[dict[str, float]], torch.Tensor]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(STEPS)], _bias(run)


@pytest.fixture(scope="module")
def setup(dist_pools, tmp_path_factory):
    """The initial weights (with a non-zero router bias) and the single-process steps."""
    from safetensors.torch import load_file, save_file

    weights = initial_weights(DEEPSEEK_V3, str(tmp_path_factory.mktemp("dsv3_init")))
    tensors = load_file(f"{weights}/model.safetensors")
    tensors[BIAS] = torch.linspace(-0.3, 0.4, 8)  # steers the routing; zeros would hide a dropped bias
    save_file(tensors, f"{weights}/model.safetensors", metadata={"format": "pt"})
    raw = _recipe(str(tmp_path_factory.mktemp("dsv3_ref")), weights)
    reference, bias = dist_pools.get(1, "gloo").run(_steps, raw)[0]
    assert torch.equal(bias, tensors[BIAS])  # several optimizer steps leave the buffer as loaded
    return weights, tensors[BIAS], reference


def test_every_layout_matches_one_process(dist_pools, setup, tmp_path):
    weights, bias, reference = setup
    pool = dist_pools.get(2, "gloo")
    for dp_replicate, sp, ep in LAYOUTS:
        raw = _recipe(str(tmp_path / f"{dp_replicate}{sp}{ep}"), weights, sp=sp, ep=ep)
        for stats, got_bias in pool.run(_steps, raw):
            layout = f"dp_replicate={dp_replicate} sp={sp} ep={ep}"
            assert torch.equal(got_bias, bias), layout
            for got, want in zip(stats, reference, strict=True):
                assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), layout
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), layout
                assert got["lr"] == want["lr"]


def _save_with_bias(ctx, raw: dict, bias: torch.Tensor) -> None:
    from veomni.train.loop import _save, build_run, train_step

    run = build_run(recipe_from_dict(raw))
    train_step(run, next(iter(run.train_data)))
    # An update from outside the gradient (as DeepSeek's own trainer balances experts): the checkpoint must carry it.
    with torch.no_grad():
        dict(run.model.named_buffers())[BIAS].copy_(bias)
    _save(run)


def _resume_and_export(ctx, raw: dict) -> tuple[int, torch.Tensor]:
    from veomni.train.loop import _export, build_run

    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    run = build_run(recipe_from_dict(resumed))
    _export(run, "hf")
    return run.step, _bias(run)


def test_router_bias_round_trips_through_dcp_and_export_under_ep(dist_pools, setup, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights, _, _ = setup
    raw = _recipe(str(tmp_path / "ckpt"), weights, ep=2)
    updated = torch.tensor([0.1234567, -1.0, 3.0e-7, 2.5, -0.75, 0.0, 1.0e5, -3.1415927])
    pool = dist_pools.get(2, "gloo")
    pool.run(_save_with_bias, raw, updated)
    for step, bias in pool.run(_resume_and_export, raw):
        assert step == 1 and torch.equal(bias, updated)
    exported = tmp_path / "ckpt" / "hf"
    assert torch.equal(load_file(exported / "model.safetensors")[BIAS], updated)
    plain = AutoModelForCausalLM.from_pretrained(exported)
    assert torch.equal(plain.state_dict()[BIAS], updated)


def _balanced_steps(ctx, raw: dict) -> dict:
    """Steps with optim.moe_bias_update_speed on: each step's all-reduced loads and the bias after it, and the
    experts this rank's router chose in the step (its own outputs, counted here apart from veomni's counter)."""
    from veomni.train import step as train_step_module
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    (router,) = run.balanced_routers
    loads, biases, chosen = [], [], []
    original = train_step_module.update_correction_biases

    def recording(routers, speed, group=None):
        out = original(routers, speed, group)
        loads.append(out[0].cpu().clone())
        biases.append(routers[0].e_score_correction_bias.cpu().clone())
        return out

    picks: list[torch.Tensor] = []
    capture = router.register_forward_hook(
        lambda m, args, out: picks.append(out[2].detach().reshape(-1).cpu())
    )
    train_step_module.update_correction_biases = recording
    try:
        it = iter(run.train_data)
        for _ in range(STEPS):
            picks.clear()
            train_step(run, next(it))
            chosen.append(torch.bincount(torch.cat(picks), minlength=8).float())
    finally:
        train_step_module.update_correction_biases = original
        capture.remove()
    return {"loads": loads, "biases": biases, "chosen": chosen}


@pytest.mark.parametrize("world_size", [1, 2])
def test_aux_free_bias_update_follows_deepseek_rule(dist_pools, setup, tmp_path, world_size):
    # bias += speed * sign(mean(load) - load) after every step, load = the step's (token, choice) pairs per expert
    # over every micro-batch and rank, as DeepSeek-V3 defines its auxiliary-loss-free balancing.
    weights, loaded, _ = setup
    speed = 0.01
    raw = _recipe(str(tmp_path), weights)
    raw["optim"]["moe_bias_update_speed"] = speed
    results = dist_pools.get(world_size, "gloo").run(_balanced_steps, raw)
    bias = loaded.clone()
    for step in range(STEPS):
        # The load is every rank's (token, choice) pairs per expert, all micro-batches.
        load = sum(r["chosen"][step] for r in results)
        assert load.sum() > 0
        for r in results:
            assert torch.equal(r["loads"][step], load)
        bias = bias + speed * torch.sign(load.mean() - load)
        for r in results:
            torch.testing.assert_close(r["biases"][step], bias, rtol=0, atol=1e-6)
    assert not torch.equal(bias, loaded)


def test_bias_update_without_such_routers_is_refused(dist_pools, tmp_path):
    from test_dit_train import _build_error
    from test_loop import DENSE

    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["optim"]["moe_bias_update_speed"] = 0.001
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError" and "has no such router; set it to 0" in message
    assert "model_type 'qwen3'" in message  # the family's hook was asked, by the config's model type


def _overflow_loads(ctx, raw: dict) -> list[float]:
    from veomni.models.moe.aux_free_balance import LOAD
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    run.loss_scale.load_state_dict({"scale": 2.0**60, "finite_steps": 0})  # overflows fp16 in any backward
    stats = train_step(run, next(iter(run.train_data)))
    (router,) = run.balanced_routers
    return [stats["skipped"], float(getattr(router, LOAD).sum())]


def test_an_fp16_overflow_step_leaves_no_load_for_the_next_bias_update(dist_pools, setup, tmp_path):
    # The overflowed step applies nothing, its router bias update included: its loads must not be added to the
    # next step's, which would then decide the signs over two steps.
    weights, _, _ = setup
    raw = _recipe(str(tmp_path), weights)
    raw["optim"]["moe_bias_update_speed"] = 0.01
    raw["model"]["dtype"] = "float16"
    skipped, load = dist_pools.get(1, "gloo").run(_overflow_loads, raw)[0]
    assert skipped == 1.0 and load == 0.0
