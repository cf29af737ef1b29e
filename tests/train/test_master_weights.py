"""The one-rank master-weights path (`veomni.core.master_weights`, chosen by `veomni.train.loop.one_rank_path`)
against FSDP2 mixed precision on a one-rank gloo mesh (``parallel.force_fsdp2``): bf16 compute over fp32 masters,
grad_accum 2, lr multipliers and a frozen module. Same losses and grad norms step for step, same fp32 weights,
same export; checkpoints resume exactly within the path and across the two paths."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_loop import DENSE, MOE, initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 4


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    return initial_weights(DENSE, str(tmp_path_factory.mktemp("mw_init")))


def mixed_recipe(tmp: Path, weights: str, *, force_fsdp2: bool, model: dict = DENSE) -> dict:
    """bf16 compute over fp32 parameters, 2 micro-batches per step, a halved lr on layer 0, layer 1's MLP frozen.

    Steps of ~300 trained tokens: a count above 256 is mostly not a bf16 number, and both paths cast every floating
    forward input to bf16, so a float ``num_items_in_batch`` would round (the trainer passes it as an integer; this
    size shows whether the two paths normalise alike)."""
    raw = tiny_recipe(
        str(tmp), model, weights=weights, steps=STEPS, tokens_per_step=1024, tokens_per_micro_batch=512
    )
    raw["model"].update({"dtype": "bfloat16", "param_dtype": "float32", "freeze": ["model.layers.1.mlp"]})
    raw["optim"]["lr_multipliers"] = {"model.layers.0": 0.5}
    raw["parallel"]["force_fsdp2"] = force_fsdp2
    return raw


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _train(ctx, raw: dict) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule

    from veomni.train.loop import _export, build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(STEPS)]
    stats = [train_step(run, step) for step in steps]
    out = _export(run, "hf")
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(f))
    return {
        "fsdp": isinstance(run.model, FSDPModule),
        "masters": run.masters is not None,
        "grad_accum": run.recipe.grad_accum(1),
        "compute_dtypes": sorted({str(p.dtype) for p in run.model.parameters()}),
        "stats": stats,
        "valid_tokens": [float(step.valid_tokens) for step in steps],
        "weights": {k: _full(v) for k, v in run.trained.state_dict().items()},
        "exp_avg": {
            name: _full(run.optimizer.state[p]["exp_avg"])
            for name, p in run.trained.named_parameters()
            if p in run.optimizer.state
        },  # fmt: skip
        "export": exported,
        "grads_left": [n for n, p in run.model.named_parameters() if p.grad is not None],
        "weights_dir": raw["model"]["weights"],
    }


@pytest.fixture(scope="module", params=["dense", "moe"])
def both(request, dist_pools, weights, tmp_path_factory) -> tuple[dict, dict]:
    """(master-weights path, FSDP2 path) results of the same recipe; dense, and Qwen3-MoE on one rank (no EP: it
    takes the new path too; aux loss and the experts' frozen router/MLP included)."""
    model = DENSE if request.param == "dense" else MOE
    start = weights if model is DENSE else initial_weights(MOE, str(tmp_path_factory.mktemp("mw_moe_init")))
    pool = dist_pools.get(1, "gloo")
    new = pool.run(
        _train, mixed_recipe(tmp_path_factory.mktemp("mw"), start, force_fsdp2=False, model=model)
    )[0]
    ref = pool.run(
        _train, mixed_recipe(tmp_path_factory.mktemp("fsdp"), start, force_fsdp2=True, model=model)
    )[0]
    return new, ref


def test_one_rank_mixed_precision_takes_the_master_weights_path(both):
    new, ref = both
    assert (new["fsdp"], new["masters"]) == (False, True)
    assert (ref["fsdp"], ref["masters"]) == (True, False)
    assert new["grad_accum"] == 2
    assert new["compute_dtypes"] == ["torch.bfloat16"]  # the module computes in bf16 ...
    assert {str(v.dtype) for v in new["weights"].values()} == {"torch.float32"}  # ... over fp32 masters
    assert new["grads_left"] == []  # bf16 gradients are transient: folded into the masters' fp32 ones


def test_losses_grad_norms_and_weights_equal_fsdp2_mixed_precision(both):
    # Bitwise: the same bf16 roundings of the same fp32 masters, the same bf16 kernels, fp32 gradient accumulation
    # in the same order, the same clip and fused AdamW on the same fp32 tensors.
    new, ref = both
    assert [s["loss"] for s in new["stats"]] == [s["loss"] for s in ref["stats"]]
    assert [s["grad_norm"] for s in new["stats"]] == [s["grad_norm"] for s in ref["stats"]]
    assert [s["lr"] for s in new["stats"]] == [s["lr"] for s in ref["stats"]]
    assert len({s["loss"] for s in new["stats"]}) == STEPS  # it trains
    assert any(float(torch.tensor(n).bfloat16()) != n for n in new["valid_tokens"])  # see mixed_recipe
    assert new["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        assert torch.equal(new["weights"][name], value), name
    assert new["exp_avg"].keys() == ref["exp_avg"].keys()
    assert not any(".layers.1.mlp." in n for n in new["exp_avg"])  # frozen: no optimizer state
    for name, value in ref["exp_avg"].items():
        assert torch.equal(new["exp_avg"][name], value), name


def test_frozen_and_scaled_parameters_behave(both):
    from safetensors.torch import load_file

    new, _ = both
    init = {}
    for f in sorted(Path(new["weights_dir"]).glob("*.safetensors")):
        init.update(load_file(f))
    # MoE experts are fused in the model and split in the HF checkpoint: the router's weight still checks.
    frozen = [k for k in new["weights"] if ".layers.1.mlp." in k and k in init]
    assert frozen and all(torch.equal(new["weights"][k], init[k].float()) for k in frozen)
    scaled = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(new["weights"][scaled], init[scaled].float())


def test_export_holds_the_fp32_masters_like_fsdp2(both):
    new, ref = both
    assert new["export"].keys() == ref["export"].keys()
    for name, value in ref["export"].items():
        assert value.dtype == torch.float32, name
        assert torch.equal(new["export"][name], value), name
        if name in new["weights"]:  # not MoE experts, which the export splits again
            assert torch.equal(new["export"][name], new["weights"][name]), name


def _resume(ctx, raw_first: dict, raw_second: dict, split: int) -> tuple[list[float], list[float]]:
    from veomni.train.loop import _save, build_run, train_step

    straight = build_run(recipe_from_dict(raw_second))
    it = iter(straight.train_data)
    want = [train_step(straight, next(it))["loss"] for _ in range(STEPS)]
    first = build_run(recipe_from_dict(raw_first))
    it = iter(first.train_data)
    got = [train_step(first, next(it))["loss"] for _ in range(split)]
    _save(first)
    resumed = copy.deepcopy(raw_second)
    resumed["checkpoint"].update({"resume": "auto", "dir": raw_first["checkpoint"]["dir"]})
    second = build_run(recipe_from_dict(resumed))
    assert second.step == split
    it = iter(second.train_data)
    got += [train_step(second, next(it))["loss"] for _ in range(STEPS - split)]
    return want, got


@pytest.mark.parametrize(
    "saved_by, resumed_by", [("masters", "masters"), ("fsdp2", "masters"), ("masters", "fsdp2")]
)
def test_resume_is_exact_within_and_across_paths(dist_pools, weights, tmp_path, saved_by, resumed_by):
    """k steps, save, resume, N - k steps equals N straight steps of the resuming path, bitwise; a checkpoint of one
    path (fp32 masters and AdamW state under the same names and shapes) resumes on the other."""
    first = mixed_recipe(tmp_path / "first", weights, force_fsdp2=saved_by == "fsdp2")
    second = mixed_recipe(tmp_path / "second", weights, force_fsdp2=resumed_by == "fsdp2")
    want, got = dist_pools.get(1, "gloo").run(_resume, first, second, 2)[0]
    assert got == want


def test_the_optimizer_must_step_the_masters():
    import torch.nn as nn

    from veomni.core.master_weights import apply_master_weights
    from veomni.train.optim import build_adamw

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    masters = apply_master_weights(model, torch.bfloat16, ("*",))
    with pytest.raises(ValueError, match="master_weights_of"):
        build_adamw(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    optimizer = build_adamw(masters.module, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    x = torch.randn(3, 4)
    for _ in range(2):  # two micro-batches: the fp32 gradient is the sum of the two bf16 ones
        model(x).float().square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad.dtype == torch.float32 for m in masters.module.parameters())
    optimizer.step()
    masters.push()
    for p, m in zip(model.parameters(), masters.module.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))
    with masters.exposed():
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def _first_step(ctx, raw: dict) -> tuple[int, dict[str, float]]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    step = next(iter(run.train_data))
    return step.valid_tokens, train_step(run, step)


def test_fp16_compute_normalises_a_step_of_more_tokens_than_fp16_holds(dist_pools, tmp_path):
    # Both paths cast every floating forward input to the compute dtype, and the loss normaliser (the step's
    # trained-token count) is a forward input: as an fp16 number a count above 65504 was inf, so the loss and every
    # gradient came out 0 and nothing trained, without a word. It reaches the model as an integer.
    import json
    import random

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
    data = tmp_path / "long.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(words, k=250))}) + "\n" for _ in range(300))
    )
    results = {}
    for dtype, force_fsdp2 in (("float32", False), ("float16", False), ("float16", True)):
        raw = tiny_recipe(str(tmp_path / f"{dtype}{force_fsdp2}"), DENSE, steps=1, tokens_per_step=66 * 1024,
                          tokens_per_micro_batch=33 * 1024)  # fmt: skip
        raw["data"].update({"train_files": [str(data)], "kind": "text"})
        raw["model"]["dtype"] = dtype
        # A smaller model: fp16 matmuls are slow on CPU.
        raw["model"]["config"].update(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        raw["parallel"]["force_fsdp2"] = force_fsdp2
        results[dtype, force_fsdp2] = dist_pools.get(1, "gloo").run(_first_step, raw)[0]
    tokens, want = results["float32", False]
    assert tokens > torch.finfo(torch.float16).max
    for path in (False, True):
        got = results["float16", path][1]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-2), f"force_fsdp2={path}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2), f"force_fsdp2={path}"
