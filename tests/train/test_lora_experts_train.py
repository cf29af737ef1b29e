"""LoRA on fused MoE experts through the trainer (``lora.targets: [attention, experts]``) on real gloo ranks: expert
parallelism (ep=2, the per-expert adapters sliced with their experts) gives the single-process loss and grad norm
per step with the base bit-identical, a resume at ep=2 (adapters-only checkpoint) is exact, and the exports of an ep=2 run (PEFT's target_parameters adapter, merged
weights) load with PEFT and plain transformers and give the run's logits."""

from __future__ import annotations

import pytest
import torch
from dist_harness import backend_params
from test_loop import MOE, initial_weights
from test_lora_train import STEPS, _lora_steps, lora_recipe

from veomni.train.recipe import recipe_from_dict

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "init": "gaussian", "targets": ["attention", "experts"]}


@pytest.fixture(scope="module")
def experts_reference(dist_pools, tmp_path_factory):
    weights = initial_weights(MOE, str(tmp_path_factory.mktemp("lora_experts_init")))
    raw = lora_recipe(str(tmp_path_factory.mktemp("lora_experts")), MOE, weights, LORA)
    return weights, dist_pools.get(1, "gloo").run(_lora_steps, raw, STEPS)[0]


@pytest.mark.slow
def test_one_process_trains_the_expert_adapters(experts_reference):
    _, ref = experts_reference
    assert ref["base_unchanged"]
    experts = [n for n in ref["trained"] if ".mlp.experts." in n]
    assert sorted({n.rsplit(".", 1)[1] for n in experts}) == [
        "down_proj_lora_A", "down_proj_lora_B", "gate_up_proj_lora_A", "gate_up_proj_lora_B",
    ]  # fmt: skip
    assert all(".self_attn." in n for n in ref["trained"] if n not in experts)
    assert ref["loss"][-1] < ref["loss"][0], ref["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_expert_parallel_matches_one_process(dist_pools, experts_reference, tmp_path, world_size, backend):
    weights, ref = experts_reference
    raw = lora_recipe(str(tmp_path / "ep2"), MOE, weights, LORA, ep=2)
    for rank in dist_pools.get(world_size, backend).run(_lora_steps, raw, STEPS):
        assert rank["base_unchanged"]
        torch.testing.assert_close(rank["loss"], ref["loss"], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(rank["grad_norm"], ref["grad_norm"], rtol=2e-4, atol=1e-6)


def _resume(ctx, raw: dict, split: int, total: int) -> dict:
    from resume_helpers import resume_before_gradients

    return resume_before_gradients(ctx, raw, split, total)


@pytest.mark.slow
def test_expert_parallel_resume_is_exact(dist_pools, experts_reference, tmp_path):
    import torch.distributed.checkpoint as dcp

    weights, _ = experts_reference
    raw = lora_recipe(str(tmp_path / "run"), MOE, weights, LORA, ep=2)
    result = dist_pools.get(2, "gloo").run(_resume, raw, 2, 4)[0]
    assert result["got"] == result["want"]
    saved = (
        dcp.FileSystemReader(str(tmp_path / "run" / "step_00000002" / "dcp"))
        .read_metadata()
        .state_dict_metadata
    )
    experts = {k: v.size for k, v in saved.items() if k.startswith("model.") and "_lora_" in k}
    # Whole [E, ...] adapters in the checkpoint (loadable at another EP degree), nothing of the frozen base.
    assert experts and all(size[0] == MOE["num_experts"] for size in experts.values()), experts
    assert all(".lora_A." in k or ".lora_B." in k or "_lora_" in k for k in saved if k.startswith("model."))


def _export_ep(ctx, raw: dict) -> dict:
    from veomni.core.parallel_state import use_parallel_state
    from veomni.train.loop import _export as export
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    for _ in range(2):
        train_step(run, next(it))
    export(run, "hf")
    # Expert-parallel dispatch reads the current parallel state (the loop's steps set it).
    with torch.no_grad(), use_parallel_state(run.state):
        logits = run.model(input_ids=torch.arange(3, 40)[None], use_cache=False).logits.float()
    return {"logits": logits}


@pytest.mark.slow
def test_exports_of_an_expert_parallel_run_load_with_peft_and_transformers(
    dist_pools, experts_reference, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    weights, _ = experts_reference
    raw = lora_recipe(str(tmp_path / "run"), MOE, weights, LORA, ep=2)
    out = dist_pools.get(2, "gloo").run(_export_ep, raw)[0]
    ids = torch.arange(3, 40)[None]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, tmp_path / "run" / "hf_adapter")
    assert adapter.peft_config["default"].target_parameters
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, out["logits"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapter(input_ids=ids).logits, out["logits"], rtol=1e-4, atol=1e-4)
