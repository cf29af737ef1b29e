"""Qwen3-Omni-MoE thinker: loading from a full Omni checkpoint (per-expert thinker tensors merged by the scoped
recipes; talker / code2wav ignored and reported), export that plain transformers loads and generates from, and
the parallel layouts on real gloo process groups: FSDP2 with audio on one rank and images on the other, Ulysses
SP2 and SP2 x EP2 (the experts split over the SP ranks) against one process.

Oracle: transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained`` on the same files, and for
the SP / EP layouts the same model in one process (fp32 loss and gradients).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loading_fixtures import eager_ops, state
from safetensors.torch import save_file
from test_qwen3_omni_moe import EAGER_OPS, MIXED, omni_batch, tiny_config
from torch.distributed.tensor import DTensor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerForConditionalGeneration as Upstream,
)

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.qwen3_omni_moe.generated import patched_modeling_qwen3_omni_moe as ours

TASK = "any_to_any"
# Stand-ins for the speech-generation sub-models' tensors in a full Omni checkpoint.
SPEECH_KEYS = {
    "talker.model.layers.0.mlp.experts.0.up_proj.weight": (8, 4),
    "talker.code_predictor.model.norm.weight": (4,),
    "code2wav.pre_transformer.layers.0.self_attn.q_proj.weight": (4, 4),
}


def original_tensors(thinker: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The thinker's tensors as a released Qwen3-Omni checkpoint names and lays them out: under ``thinker.``, the
    language model under ``thinker.model.``, and each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` apart."""
    out = {}
    for key, value in thinker.state_dict().items():
        for ours_prefix, original in (("model.language_model.", "thinker.model."), ("model.audio_tower.",
                                      "thinker.audio_tower."), ("model.visual.", "thinker.visual.")):  # fmt: skip
            if key.startswith(ours_prefix):
                key = original + key[len(ours_prefix) :]
                break
        else:
            key = "thinker." + key
        if key.endswith("mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e].contiguous()
                out[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e].contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                out[key.replace("down_proj", f"{e}.down_proj.weight")] = value[e].contiguous()
        else:
            out[key] = value.contiguous()
    return out


@pytest.fixture(scope="module")
def omni_checkpoint(tmp_path_factory) -> str:
    """A full Qwen3-Omni layout: config.json of model_type qwen3_omni_moe and thinker + talker + code2wav keys."""
    path = tmp_path_factory.mktemp("qwen3_omni_moe")
    torch.manual_seed(5)
    thinker = Upstream(tiny_config())
    tensors = original_tensors(thinker)
    assert "thinker.model.layers.1.mlp.experts.3.down_proj.weight" in tensors
    tensors.update({k: torch.ones(shape) for k, shape in SPEECH_KEYS.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
              "thinker_config": tiny_config().to_dict(), "enable_audio_output": True}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_thinker_loads_from_the_full_omni_layout_and_reports_the_speech_keys(omni_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="veomni.models.build"):
        model = build_model(omni_checkpoint, weights=omni_checkpoint, ops=eager_ops(), task=TASK)
    assert type(model) is ours.Qwen3OmniMoeThinkerForConditionalGeneration
    ref = Upstream.from_pretrained(omni_checkpoint)
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]
    assert got["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 48, 64)
    assert "3 checkpoint tensors not loaded" in caplog.text and "{'code2wav': 1, 'talker': 2}" in caplog.text


def test_export_loads_in_plain_transformers_and_generates_from_audio_and_image(omni_checkpoint, tmp_path):
    model = build_model(omni_checkpoint, weights=omni_checkpoint, ops=eager_ops(), task=TASK)
    export_hf(model, tmp_path / "out")
    config = json.loads((Path(tmp_path) / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe_thinker"
    back = Upstream.from_pretrained(tmp_path / "out").eval()
    ref = Upstream.from_pretrained(omni_checkpoint).eval()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    batch = omni_batch([[("audio", 130), ("image", 4)]], seed=2)
    batch.pop("labels")
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    generated = back.generate(**batch, **settings)
    assert generated.shape == (1, batch["input_ids"].shape[1] + 4)
    assert torch.equal(generated, ref.generate(**batch, **settings))
    assert torch.equal(generated, model.eval().generate(**batch, **settings))


def _rank_batch(rank: int) -> dict[str, torch.Tensor]:
    # Rank 0: audio only (no pixel_values); rank 1: images only (no input_features).
    rows = [[("audio", 130)], [("audio", 45)]] if rank == 0 else [[("image", 4)], [("image", 8)]]
    return omni_batch(rows, seed=21 + rank)


def _fsdp_step(ctx, path: str) -> dict:
    pstate = state(ctx)
    model = build_model(path, weights=path, ops=eager_ops(), parallel_state=pstate, task=TASK)
    batch = {k: v.to(ctx.device) for k, v in _rank_batch(ctx.rank).items()}
    with use_parallel_state(pstate):
        loss = model(**batch).loss
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
    return {"loss": float(loss.detach()), "grads": grads, "sharded": isinstance(p, DTensor)}


def test_fsdp2_with_audio_on_one_rank_and_images_on_the_other_matches_one_process(
    dist_pools, omni_checkpoint
):
    results = dist_pools.get(2).run(_fsdp_step, omni_checkpoint)
    ref = Upstream.from_pretrained(omni_checkpoint)
    losses = [ref(**_rank_batch(rank)).loss for rank in (0, 1)]
    # FSDP2 averages gradients over the ranks: the reference objective is the mean of the per-rank losses.
    (sum(losses) / 2).backward()
    for rank, result in enumerate(results):
        assert result["sharded"]
        assert result["loss"] == pytest.approx(float(losses[rank].detach()), rel=1e-5)
    grads = results[0]["grads"]
    assert sorted(grads) == sorted(n for n, p in ref.named_parameters() if p.grad is not None)
    for name, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(
                grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
    # Both towers got the real (averaged) gradients on both ranks, though each rank saw one modality only.
    for name in ("model.audio_tower.conv2d1.weight", "model.visual.patch_embed.proj.weight"):
        assert grads[name].abs().sum() > 0
        assert torch.equal(results[1]["grads"][name], grads[name]), name


def _sp_case(ctx, ep: int) -> dict:
    from veomni.core.ep import apply_expert_plan
    from veomni.core.sp import slice_sequence
    from veomni.kernels import OpsConfig
    from veomni.models.hf.attention import register_hf_attention
    from veomni.models.hf.kernel_hooks import apply_ops

    register_hf_attention()
    pstate = build_parallel_state(ParallelDims(sp=ctx.world_size, ep=ep), ctx.device_type)
    group = pstate.sp_group
    torch.manual_seed(0)
    model = ours.Qwen3OmniMoeThinkerForConditionalGeneration(tiny_config())
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": "torch"}))
    reference = copy.deepcopy(model)
    batch = omni_batch(MIXED, seed=9)
    labels = batch.pop("labels")
    batch.pop("attention_mask")  # packed-style input: positions given, no padding mask
    # One more text column makes the width (47) even: SP would pad an odd width with tokens that the routers see
    # and that the SP-global load-balancing statistics count (no attention mask), which one process has not.
    extra = torch.full_like(labels[:, :1], 7)
    labels, batch["input_ids"] = (torch.cat([t, extra], dim=1) for t in (labels, batch["input_ids"]))
    assert batch["input_ids"].shape[1] % ctx.world_size == 0
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"], batch["image_grid_thw"], None, torch.ones_like(batch["input_ids"]), False,
        batch["feature_attention_mask"].sum(-1), None,
    )  # fmt: skip
    position_ids = position_ids.long()
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    items = int((shift != -100).sum())

    ref = reference(**batch, position_ids=position_ids, shift_labels=shift, num_items_in_batch=items).loss
    ref.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    shards = (
        apply_expert_plan(model, model.get_parallel_plan(), ep_size=ep, ep_rank=pstate.ep_rank)
        if ep > 1
        else {}
    )
    with use_parallel_state(pstate):
        loss = model(
            **{**batch, "input_ids": slice_sequence(batch["input_ids"], 1, group)},
            position_ids=slice_sequence(position_ids, 2, group),
            shift_labels=slice_sequence(shift, 1, group, pad_value=-100).contiguous(),
            num_items_in_batch=items,
        ).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst, worst_name, missing = 0.0, None, []
    for name, param in model.named_parameters():
        want = ref_grads.get(name)
        if want is None:
            continue
        if param.grad is None:
            missing.append(name)
            continue
        if name in shards:
            # Tokens of both SP ranks travel to their experts: the local slice holds the whole gradient.
            got, want = param.grad, want[shards[name].start : shards[name].stop]
        else:
            got = param.grad.clone()
            dist.all_reduce(got, group=group)
        error = float((got - want).abs().max() / (1e-5 * want.abs().max() + 1e-7))
        if error > worst:
            worst, worst_name = error, name
    return {"loss": float(total), "ref_loss": float(ref.detach()), "worst_grad": (worst, worst_name), "missing": missing,
            "experts_sharded": sorted(shards)}  # fmt: skip


@pytest.mark.parametrize("ep", [1, 2], ids=["sp2", "sp2xep2"])
def test_thinker_sp2_and_sp2_x_ep2_equal_one_process(dist_pools, ep):
    """Audio, images and text over 3 rows (lengths not divisible by 2): the language model runs on each rank's
    slice, the audio tower on its frame slice, the ViT on its patch slice; with ep=2 each rank holds half of the
    experts. Loss (summed over ranks, router aux term included) and gradients equal one process."""
    for result in dist_pools.get(2).run(_sp_case, ep):
        assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-5)
        assert not result["missing"]
        assert result["worst_grad"][0] <= 1.0, result
        assert len(result["experts_sharded"]) == (2 if ep == 2 else 0)
