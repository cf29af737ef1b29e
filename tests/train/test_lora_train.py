"""LoRA through the trainer (`lora:` recipe section) on real gloo ranks: FSDP2, Ulysses SP and EP layouts give the
single-process loss and grad norm per step, the base stays bit-identical, a resume (adapters-only checkpoint) is
exact, a resume into another adapter setup is refused naming the difference, and the exports load with PEFT and
plain transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import backend_params
from test_loop import DENSE, MOE, initial_weights, tiny_recipe

from veomni.train.recipe import RecipeError, recipe_from_dict

STEPS = 3
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "init": "gaussian"}


def lora_recipe(tmp: str, model: dict, weights: str, lora: dict | None = None, **kw) -> dict:
    raw = tiny_recipe(tmp, model, weights=weights, **kw)
    raw["lora"] = dict(lora or LORA)
    raw["optim"]["lr"] = 1e-2
    return raw


def _lora_steps(ctx, raw: dict, n: int) -> dict:
    """Per step (loss, grad norm); whether every frozen parameter kept its loaded value; trained names."""
    from veomni.models.loading.targets import gather_target, model_targets
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    targets = model_targets(run.model)
    frozen = [n for n, p in run.model.named_parameters() if not p.requires_grad]
    before = {n: gather_target(targets[n], run.state).clone() for n in frozen}
    it = iter(run.train_data)
    stats = [train_step(run, next(it)) for _ in range(n)]
    unchanged = all(torch.equal(gather_target(targets[n], run.state), before[n]) for n in frozen)
    trained = sorted(n for n, p in run.model.named_parameters() if p.requires_grad)
    return {"loss": [float(s["loss"]) for s in stats], "grad_norm": [float(s["grad_norm"]) for s in stats],
            "base_unchanged": unchanged, "trained": trained}  # fmt: skip


@pytest.fixture(scope="module")
def lora_references(dist_pools, tmp_path_factory):
    pool = dist_pools.get(1, "gloo")
    out = {}
    for name, model in {"dense": DENSE, "moe": MOE}.items():
        weights = initial_weights(model, str(tmp_path_factory.mktemp(f"lora_{name}_init")))
        raw = lora_recipe(str(tmp_path_factory.mktemp(f"lora_{name}")), model, weights)
        out[name] = (weights, pool.run(_lora_steps, raw, STEPS)[0])
    return out


def test_one_process_trains_adapters_only(lora_references):
    for name, (_, ref) in lora_references.items():
        assert ref["base_unchanged"], f"{name}: a frozen parameter changed"
        assert ref["trained"] and all(".lora_A." in n or ".lora_B." in n for n in ref["trained"]), ref[
            "trained"
        ]
        assert ref["loss"][-1] < ref["loss"][0], f"{name}: the loss did not fall: {ref['loss']}"
    # MoE families default to attention only (PEFT re-targets their MLP names on load).
    assert all(".self_attn." in n for n in lora_references["moe"][1]["trained"])


@pytest.mark.slow
@pytest.mark.parametrize("world_size, backend", backend_params(2))
@pytest.mark.parametrize("model_name, layouts", [("dense", [(1, 1, 1), (1, 2, 1)]), ("moe", [(1, 1, 2)])])
def test_layouts_match_one_process(
    dist_pools, lora_references, tmp_path, world_size, backend, model_name, layouts
):
    model = {"dense": DENSE, "moe": MOE}[model_name]
    weights, ref = lora_references[model_name]
    pool = dist_pools.get(world_size, backend)
    for dp_replicate, sp, ep in layouts:
        raw = lora_recipe(str(tmp_path / f"{dp_replicate}{sp}{ep}"), model, weights, dp_replicate=dp_replicate,
                          sp=sp, ep=ep)  # fmt: skip
        got = pool.run(_lora_steps, raw, STEPS)
        for rank in got:
            assert rank["base_unchanged"], (dp_replicate, sp, ep)
            torch.testing.assert_close(rank["loss"], ref["loss"], rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(rank["grad_norm"], ref["grad_norm"], rtol=2e-4, atol=1e-6)


def _resume(ctx, raw: dict, split: int, total: int) -> dict:
    from resume_helpers import resume_before_gradients

    return resume_before_gradients(ctx, raw, split, total)


def _dcp_keys(path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return sorted(
        k
        for k in dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
        if k.startswith("model.")
    )


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_resume_is_exact_and_holds_adapters_only(dist_pools, lora_references, tmp_path, world_size, backend):
    weights, _ = lora_references["dense"]
    raw = lora_recipe(str(tmp_path / "run"), DENSE, weights)
    result = dist_pools.get(world_size, backend).run(_resume, raw, 2, 4)[0]
    assert result["got"] == result["want"]
    keys = _dcp_keys(tmp_path / "run" / "step_00000002")
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:6]


def _build_and_save(ctx, raw: dict) -> None:
    from veomni.train.loop import _save, build_run

    _save(build_run(recipe_from_dict(raw)))


def _build(ctx, raw: dict) -> None:
    from veomni.train.loop import build_run

    build_run(recipe_from_dict(raw))


@pytest.mark.parametrize("change, named", [({"rank": 8}, "lora.rank: saved 4, now 8"),
                                           ({"targets": ["q_proj"]}, "lora.targets"),
                                           ({"enabled": False, "rank": 16, "alpha": 32.0, "init": "default"},
                                            "holds LoRA adapters only")])  # fmt: skip
def test_resume_into_other_adapters_is_refused(dist_pools, lora_references, tmp_path, change, named):
    weights, _ = lora_references["dense"]
    raw = lora_recipe(str(tmp_path / "run"), DENSE, weights)
    pool = dist_pools.get(1, "gloo")
    pool.run(_build_and_save, raw)
    other = copy.deepcopy(raw)
    other["checkpoint"]["resume"] = "auto"
    other["lora"].update(change)
    if not other["lora"]["enabled"]:
        other["lora"] = {}
    with pytest.raises(Exception, match=named):
        pool.run(_build, other)


def _export(ctx, raw: dict) -> dict:
    from veomni.train.loop import _export as export
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    for _ in range(2):
        train_step(run, next(it))
    merged = export(run, "hf")
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        logits = run.model(input_ids=ids, use_cache=False).logits.float()
    return {"merged": str(merged), "logits": logits}


def test_exports_load_with_peft_and_transformers(dist_pools, lora_references, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    weights, _ = lora_references["dense"]
    raw = lora_recipe(str(tmp_path / "run"), DENSE, weights)
    out = dist_pools.get(1, "gloo").run(_export, raw)[0]
    ids = torch.arange(3, 40)[None]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32),
                                        tmp_path / "run" / "hf_adapter")  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, out["logits"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapter(input_ids=ids).logits, out["logits"], rtol=1e-4, atol=1e-4)


def test_lora_keys_without_enabled_are_refused(tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE, weights=str(tmp_path))
    raw["lora"] = {"rank": 8}
    with pytest.raises(RecipeError, match=r"\['lora.rank'\] set but lora.enabled is false"):
        recipe_from_dict(raw)
    raw["lora"] = {"enabled": True, "init": "pissa"}
    with pytest.raises(RecipeError, match="lora.init"):
        recipe_from_dict(raw)
