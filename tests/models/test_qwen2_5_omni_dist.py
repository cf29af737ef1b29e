"""Qwen2.5-Omni thinker: loading from a full Omni checkpoint (talker / token2wav ignored and reported), export
that plain transformers loads and generates from, and FSDP2 with rank-asymmetric modalities (gloo).

Oracle: transformers' ``Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained`` on the same files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from loading_fixtures import eager_ops, state
from safetensors.torch import save_file
from test_qwen2_5_omni import omni_batch, tiny_config
from torch.distributed.tensor import DTensor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniThinkerForConditionalGeneration as Upstream,
)

from veomni.core.parallel_state import use_parallel_state
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.qwen2_5_omni.generated import patched_modeling_qwen2_5_omni as ours

TASK = "any_to_any"
# Stand-ins for the speech-generation sub-models' tensors in a full Omni checkpoint.
SPEECH_KEYS = {
    "talker.model.layers.0.mlp.up_proj.weight": (8, 4),
    "talker.codec_head.weight": (6, 4),
    "token2wav.code2wav_dit_model.input_embed.proj.weight": (4, 4),
}


def _original_key(key: str) -> str:
    """The original Omni checkpoint's name of a thinker parameter (transformers' recipe maps it back)."""
    for ours_prefix, original in (("model.language_model.", "model."), ("model.audio_tower.", "audio_tower."),
                                  ("model.visual.", "visual.")):  # fmt: skip
        if key.startswith(ours_prefix):
            return "thinker." + original + key[len(ours_prefix) :]
    return "thinker." + key


@pytest.fixture(scope="module")
def omni_checkpoint(tmp_path_factory) -> str:
    """A full Qwen2.5-Omni layout: config.json of model_type qwen2_5_omni and thinker + talker + token2wav keys."""
    path = tmp_path_factory.mktemp("qwen2_5_omni")
    torch.manual_seed(5)
    thinker = Upstream(tiny_config())
    tensors = {_original_key(k): v.contiguous() for k, v in thinker.state_dict().items()}
    tensors.update({k: torch.ones(shape) for k, shape in SPEECH_KEYS.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniForConditionalGeneration"],
              "thinker_config": tiny_config().to_dict(), "enable_audio_output": True}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_thinker_loads_from_the_full_omni_layout_and_reports_the_speech_keys(omni_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="veomni.models.build"):
        model = build_model(omni_checkpoint, weights=omni_checkpoint, ops=eager_ops(), task=TASK)
    assert type(model) is ours.Qwen2_5OmniThinkerForConditionalGeneration
    ref = Upstream.from_pretrained(omni_checkpoint)
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]
    assert "3 checkpoint tensors not loaded" in caplog.text and "{'talker': 2, 'token2wav': 1}" in caplog.text


def test_export_loads_in_plain_transformers_and_generates_from_audio_and_image(omni_checkpoint, tmp_path):
    model = build_model(omni_checkpoint, weights=omni_checkpoint, ops=eager_ops(), task=TASK)
    export_hf(model, tmp_path / "out")
    config = json.loads((Path(tmp_path) / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_omni_thinker"
    back = Upstream.from_pretrained(tmp_path / "out").eval()
    ref = Upstream.from_pretrained(omni_checkpoint).eval()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    batch = omni_batch([[("audio", 20), ("image", 4)]], seed=2)
    batch.pop("labels")
    generated = back.generate(**batch, max_new_tokens=4, do_sample=False)
    expected = ref.generate(**batch, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, batch["input_ids"].shape[1] + 4)
    assert torch.equal(generated, expected)


def _rank_batch(rank: int) -> dict[str, torch.Tensor]:
    # Rank 0: audio only (no pixel_values); rank 1: images only (no input_features).
    rows = [[("audio", 20)], [("audio", 11)]] if rank == 0 else [[("image", 4)], [("image", 8)]]
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
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert name == "model.audio_tower.audio_bos_eos_token.weight", name  # unused upstream too
            continue
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    # Both towers got the real (averaged) gradients on both ranks, though each rank saw one modality only.
    for name in ("model.audio_tower.conv1.weight", "model.visual.patch_embed.proj.weight"):
        assert grads[name].abs().sum() > 0
        assert torch.equal(results[1]["grads"][name], grads[name]), name
