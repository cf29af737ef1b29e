"""Qwen3-VL-MoE through the trainer (task vlm): every (dp, sp, ep) layout on 2 gloo ranks gives the one-process
per-step loss and grad norm (fp32), with micro-batches that hold no image on some ranks; the router aux loss is
found in ``text_config`` and enters the gradient; MFU counts the routed experts at top_k / E.

Processor and recipe come from test_vlm_train; the data (unshuffled) alternates runs of image rows and of longer
text-only rows, so that under data parallelism one rank's micro-batch has images and the other's none.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_vlm_train import draw, make_processor_dir, tiny_config, vlm_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 2
LAYOUTS = [
    (2, 1, 1),
    (1, 2, 1),
    (1, 1, 2),
    (1, 2, 2),
]  # (dp_replicate, sp, ep) on 2 ranks; dp_shard fills the rest
MOE_TEXT = {"moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
            "router_aux_loss_coef": 0.05}  # fmt: skip


def moe_config(**text) -> dict:
    values = copy.deepcopy(tiny_config())
    values["text_config"].update({**MOE_TEXT, **text})
    return values


def make_data(root, rows: int = 32) -> str:
    """Runs of six short image rows, then two long text-only rows (about one micro-batch each run)."""
    lines = []
    for k in range(rows):
        if k % 8 < 6:
            draw("red" if k % 2 else "blue", "dot" if k % 3 else "square", (8 + 4 * (k % 2), 8)).save(
                root / f"{k}.png"
            )
            user: list | str = [
                {"type": "image", "image": f"{k}.png"},
                {"type": "text", "text": "What is this?"},
            ]
            answer = f"A {'red' if k % 2 else 'blue'} shape."
        else:
            user, answer = "Name some colours.", " ".join(["red green blue yellow"] * 24)
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": turns}))
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def initial_weights(out, **text) -> str:
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model("qwen3_vl_moe", **moe_config(**text))
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm_moe")
    (root / "media").mkdir()
    return {
        "processor": make_processor_dir(root / "processor"),
        "train": make_data(root / "media"),
        "media": str(root / "media"),
        "weights": initial_weights(root / "weights"),
    }


def moe_recipe(assets: dict, out: str, *, dp_replicate: int = 1, sp: int = 1, ep: int = 1) -> dict:
    raw = vlm_recipe(assets, out, sp=sp, steps=STEPS)
    raw["parallel"] = {"dp_replicate": dp_replicate, "sp": sp, "ep": ep}
    raw["ops"] = {"moe_experts": "torch"}
    raw["data"]["shuffle"] = False
    return raw


def _steps(ctx, raw: dict) -> dict:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(STEPS)]
    imageless = sum(b["image_grid_thw"] is None for s in steps for b in s.micro_batches)
    found = {"task_coef": run.task.aux_loss_coef, "model_coef": run.model.router_aux_loss_coef}
    flops = run.task.flops_per_token
    return {"stats": [train_step(run, s) for s in steps], "imageless": imageless, "flops": flops, **found}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = moe_recipe(assets, str(tmp_path_factory.mktemp("one")))
    return dist_pools.get(1, "gloo").run(_steps, raw)[0]


def test_aux_loss_is_read_from_text_config_and_enters_the_gradient(dist_pools, assets, one_rank, tmp_path):
    # The loop adds the aux term itself: the task holds text_config's coefficient, the model's copy is zeroed.
    assert one_rank["task_coef"] == 0.05 and one_rank["model_coef"] == 0.0
    raw = moe_recipe(assets, str(tmp_path))
    raw["model"]["weights"] = initial_weights(tmp_path / "no_aux", router_aux_loss_coef=0.0)
    without = dist_pools.get(1, "gloo").run(_steps, raw)[0]
    assert without["task_coef"] == 0.0
    # Same weights and data: the reported (LM) loss of step 0 is equal, its gradient is not.
    assert without["stats"][0]["loss"] == pytest.approx(one_rank["stats"][0]["loss"], rel=1e-6)
    assert without["stats"][0]["grad_norm"] != pytest.approx(one_rank["stats"][0]["grad_norm"], rel=1e-6)


def test_every_layout_matches_one_process(dist_pools, assets, one_rank, tmp_path):
    pool = dist_pools.get(2, "gloo")
    for dp_replicate, sp, ep in LAYOUTS:
        layout = f"dp_replicate={dp_replicate} sp={sp} ep={ep}"
        raw = moe_recipe(
            assets, str(tmp_path / layout.replace(" ", "_")), dp_replicate=dp_replicate, sp=sp, ep=ep
        )
        results = pool.run(_steps, raw)
        imageless = [r["imageless"] for r in results]
        assert sum(imageless) > 0, layout  # step 0's second micro-batch is text only
        if sp == 1:  # data parallel: one rank's micro-batch has images while the other's has none
            assert len(set(imageless)) == 2, (layout, imageless)
        for result in results:
            for step, (got, want) in enumerate(zip(result["stats"], one_rank["stats"], strict=True)):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (layout, step)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (layout, step)


def test_mfu_counts_routed_experts_at_top_k_over_e():
    from transformers import AutoConfig

    from veomni.train.loop import meta_instance
    from veomni.train.tasks import build_task

    probe = meta_instance(AutoConfig.for_model("qwen3_vl_moe", **moe_config()), "image_text_to_text")
    task = build_task("vlm", probe)
    dense, experts = 0.0, 0.0
    for name, param in probe.named_parameters():
        if param.dim() < 2 or name.startswith("model.visual.") or "embed_tokens" in name:
            continue
        if ".mlp.experts." in name:
            experts += param.numel()
        else:
            dense += param.numel()
    assert experts > 0 and task.flops_per_token == pytest.approx(6.0 * (dense + experts * 2 / 4))


def test_resumes_exactly_from_a_checkpoint_saved_before_the_first_step(dist_pools, assets, tmp_path):
    # No parameter, experts and vision tower included, has AdamW state at step 0 (issue 42).
    from resume_helpers import check_exact_resume, resume_before_gradients

    (result,) = dist_pools.get(1, "gloo").run(
        resume_before_gradients, moe_recipe(assets, str(tmp_path)), 0, 2
    )
    check_exact_resume(result, some="experts")
