"""The generated Qwen2.5-Omni thinker adapter against upstream transformers, single process.

Oracle: transformers' own ``Qwen2_5OmniThinkerForConditionalGeneration`` with the same weights; with eager ops
and HF attention names the adapter computes exactly what upstream computes (loss and every gradient).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as upstream

from veomni.models.qwen2_5_omni.generated import patched_modeling_qwen2_5_omni as ours
from veomni.models.registry import MODELS

AUDIO, IMAGE, VIDEO, V_START, V_END, A_START, A_END = 100, 101, 102, 103, 104, 105, 106
VOCAB, MELS = 128, 16


def tiny_config() -> Qwen2_5OmniThinkerConfig:
    """2 text layers with mrope, a 2-block windowed ViT, a 2-layer audio tower (8-frame chunks)."""
    return Qwen2_5OmniThinkerConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 8, "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
        audio_config={
            "num_mel_bins": MELS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 48,
            "d_model": 32, "max_source_positions": 32, "n_window": 4, "output_dim": 64,
        },
        audio_token_index=AUDIO, image_token_index=IMAGE, video_token_index=VIDEO, audio_start_token_id=A_START,
        audio_end_token_id=A_END, vision_start_token_id=V_START, vision_end_token_id=V_END,
    )  # fmt: skip


def audio_tokens(frames: int) -> int:
    """LLM tokens of one clip of ``frames`` mel frames (conv stride 2, then the stride-2 pooler)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def omni_batch(rows: list[list[tuple[str, int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of text with audio (``("audio", frames)``) and image (``("image", side)``, side x side patches) runs.

    Rows are right-padded with text to one length; labels are the ids with placeholders ignored (-100).
    """
    gen = torch.Generator().manual_seed(seed)
    ids_rows, clips, pixels, grids = [], [], [], []
    for items in rows:
        ids: list[int] = torch.randint(0, 90, (2,), generator=gen).tolist()
        for kind, size in items:
            if kind == "audio":
                ids += [A_START] + [AUDIO] * audio_tokens(size) + [A_END]
                clips.append(torch.randn(MELS, size, generator=gen))
            else:
                ids += [V_START] + [IMAGE] * (size * size // 4) + [V_END]
                pixels.append(torch.randn(size * size, 3 * 2 * 2 * 2, generator=gen))
                grids.append((1, size, size))
            ids += torch.randint(0, 90, (2,), generator=gen).tolist()
        ids_rows.append(ids)
    width = max(len(r) for r in ids_rows)
    input_ids = torch.tensor(
        [r + torch.randint(0, 90, (width - len(r),), generator=gen).tolist() for r in ids_rows]
    )
    labels = input_ids.masked_fill(input_ids >= AUDIO, -100)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if clips:
        frames = max(c.shape[1] for c in clips)
        batch["input_features"] = torch.stack(
            [torch.nn.functional.pad(c, (0, frames - c.shape[1])) for c in clips]
        )
        batch["feature_attention_mask"] = torch.stack(
            [torch.arange(frames) < c.shape[1] for c in clips]
        ).long()
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
        batch["image_grid_thw"] = torch.tensor(grids)
    return batch


MIXED = [[("audio", 20), ("image", 4)], [("audio", 13)], [("image", 8)]]


def pair(seed: int = 0):
    torch.manual_seed(seed)
    ref = upstream.Qwen2_5OmniThinkerForConditionalGeneration(tiny_config()).eval()
    model = ours.Qwen2_5OmniThinkerForConditionalGeneration(tiny_config()).eval()
    model.load_state_dict(ref.state_dict())
    return ref, model


def test_registry_and_generated_file_hold_the_thinker_only():
    assert (
        MODELS.model_class(tiny_config(), "any_to_any").cls is ours.Qwen2_5OmniThinkerForConditionalGeneration
    )
    names = set(vars(ours))
    assert not {n for n in names if "Talker" in n or "Token2Wav" in n or n.startswith("DiT")}
    assert "Qwen2_5OmniForConditionalGeneration" not in names
    assert all(hasattr(ours, n) for n in ours.__all__)


def test_eager_parity_with_upstream_on_a_mixed_batch():
    ref, model = pair()
    batch = omni_batch(MIXED)
    want, got = ref(**batch), model(**batch)
    want.loss.backward()
    got.loss.backward()
    assert torch.equal(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if theirs[name].grad is None:
            # Upstream never uses audio_bos_eos_token in the forward; neither do we.
            assert p.grad is None and name == "model.audio_tower.audio_bos_eos_token.weight", name
            continue
        torch.testing.assert_close(
            p.grad, theirs[name].grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
    # Every tower took part: audio and vision gradients are non-zero.
    assert model.model.audio_tower.conv1.weight.grad.abs().sum() > 0
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def test_audio_changes_the_loss_and_miscounted_placeholders_raise():
    _, model = pair()
    batch = omni_batch([[("audio", 20)], [("audio", 9)]])
    base = model(**batch).loss
    other = dict(batch, input_features=batch["input_features"] * 3.0)
    assert not torch.allclose(model(**other).loss, base)
    # One audio placeholder short: upstream's masked_scatter would silently use a prefix of the features.
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == AUDIO).nonzero()[0]] = 5
    with pytest.raises(
        ValueError, match=r"audio placeholder tokens and audio features differ: 6 tokens .* 7 feature rows"
    ):
        model(**dict(batch, input_ids=ids))
    with pytest.raises(ValueError, match="without feature_attention_mask"):
        model(input_ids=batch["input_ids"], input_features=batch["input_features"])


def test_dummy_forwards_reach_every_tower_parameter():
    _, model = pair()
    for tower in (model.model.audio_tower, model.model.visual):
        out = tower.dummy_forward()
        assert out.shape == () and float(out.detach()) == 0.0
        out.backward()
        missing = [n for n, p in tower.named_parameters() if p.grad is None]
        assert missing == (["audio_bos_eos_token.weight"] if tower is model.model.audio_tower else [])
    model.to(torch.bfloat16)
    assert model.model.audio_tower.dummy_forward().dtype == torch.bfloat16


def test_talker_and_speech_generation_raise():
    _, model = pair()
    with pytest.raises(NotImplementedError, match="thinker only"):
        model.enable_talker()
    batch = omni_batch([[("audio", 12)]])
    with pytest.raises(NotImplementedError, match=r"speech arguments \['speaker'\]"):
        model.generate(input_ids=batch["input_ids"], speaker="Chelsie")


def test_host_positions_are_the_models_own_and_pickle():
    import pickle

    from veomni.models.qwen2_5_omni.positions import Qwen2_5OmniPositions

    _, model = pair()
    batch = omni_batch([[("audio", 20), ("image", 4), ("audio", 9), ("image", 8)]])
    positions = pickle.loads(pickle.dumps(Qwen2_5OmniPositions(tiny_config())))
    got = positions(
        batch["input_ids"][0].numpy(),
        image_grid_thw=batch["image_grid_thw"].numpy(),
        audio_frames=batch["feature_attention_mask"].sum(-1).numpy(),
    )
    want, _ = model.model.get_rope_index(
        batch["input_ids"], batch["image_grid_thw"], None, batch["attention_mask"], False,
        batch["feature_attention_mask"].sum(-1), None,
    )  # fmt: skip
    assert got.shape == (3, batch["input_ids"].shape[1])
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert not (got[1] == got[0]).all()  # the images' rows/columns differ from the temporal axis
    # The packed path (no attention_mask, explicit positions) gives the same loss as the model's own positions.
    explicit = model(**{**batch, "attention_mask": None}, position_ids=torch.as_tensor(got)[:, None]).loss
    assert torch.equal(explicit, model(**batch).loss)
    # Without a mask upstream silently uses 1-D positions for the images; the adapter still builds mrope ones.
    assert torch.equal(model(**{**batch, "attention_mask": None}).loss, explicit)


def test_veomni_attention_in_the_towers_matches_upstream_eager():
    """With a veomni_* implementation the towers attend through the encoder varlen entry (one call over all
    chunks / windows, no per-chunk split); the result equals upstream's eager per-chunk loop."""
    from loading_fixtures import EAGER

    from veomni.kernels import OpsConfig
    from veomni.models.build import build_model

    ref, _ = pair()
    model = build_model(tiny_config(), ops=OpsConfig(**{**EAGER, "attention": "sdpa"}), task="any_to_any",
                        init_device="cpu")  # fmt: skip
    model.load_state_dict(ref.state_dict())
    assert model.model.audio_tower.config._attn_implementation.startswith("veomni_")
    assert model.model.visual.config._attn_implementation.startswith("veomni_")
    batch = omni_batch(MIXED)
    want, got = ref(**batch), model(**batch)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    theirs = dict(ref.named_parameters())
    for name in ("model.audio_tower.layers.0.self_attn.q_proj.weight", "model.visual.blocks.0.attn.q.weight",
                 "model.language_model.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        got_grad = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(got_grad, theirs[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
def test_gpu_default_ops_match_upstream():
    """On a GPU: the default OpsConfig (veomni attention incl. the towers' encoder varlen entry, fused linear
    cross-entropy) against upstream eager, fp32 with TF32 off; and the bf16 dummy forwards take the weights' dtype."""
    from veomni.kernels import OpsConfig
    from veomni.models.hf.kernel_hooks import apply_ops

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref, model = pair()
    ref, model = ref.cuda(), model.cuda()
    apply_ops(model, OpsConfig(attention="sdpa", cross_entropy="triton"))
    batch = {k: v.cuda() for k, v in omni_batch(MIXED, seed=4).items()}
    want, got = ref(**batch), model(**batch)
    assert got.logits is None  # the fused loss never materialises logits
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(
                p.grad, theirs[name].grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
    model.to(torch.bfloat16)
    for tower in (model.model.audio_tower, model.model.visual):
        assert tower.dummy_forward().dtype == torch.bfloat16


def test_norms_mlps_and_rope_go_through_the_kernel_set():
    """Every RMSNorm (text and vision) and both MLPs (text, biased vision) call the instance's kernel set:
    recording backends stand in for the kernels and must see every call (a module that kept upstream's code would
    not); the model's loss stays upstream's. (The text RoPE is Qwen2-VL's adapter function, tested there.)"""
    from loading_fixtures import EAGER

    from veomni.kernels import OpsConfig
    from veomni.models.build import build_model

    ref, _ = pair()
    model = build_model(tiny_config(), ops=OpsConfig(**{**EAGER, "attention": "sdpa", "rms_norm": "torch"}),
                        task="any_to_any", init_device="cpu")  # fmt: skip
    model.load_state_dict(ref.state_dict())
    kernels = model.veomni_kernels
    calls = {"rms_norm": 0, "swiglu": 0}
    rms, table = kernels.get("rms_norm", "standard"), dict(kernels._table)

    def counting_rms(*args, **kwargs):
        calls["rms_norm"] += 1
        return rms(*args, **kwargs)

    def counting_swiglu(gate, up):
        calls["swiglu"] += 1
        return torch.nn.functional.silu(gate) * up

    table[("rms_norm", "standard")], table[("swiglu", "standard")] = counting_rms, counting_swiglu
    swapped = type(kernels)(kernels.config.__class__(**{**EAGER, "attention": "sdpa", "rms_norm": "torch",
                                                        "swiglu": "triton"}), table, kernels._missing)  # fmt: skip
    for module in model.modules():
        object.__setattr__(module, "veomni_kernels", swapped)
    norms = sum(type(m).__name__ == "Qwen2_5OmniRMSNorm" for m in model.modules())
    mlps = sum(type(m).__name__ in ("Qwen2MLP", "Qwen2_5OmniMLP") for m in model.modules())
    batch = omni_batch(MIXED)
    want, got = ref(**batch), model(**batch)
    # The vision tower runs once over all images, the text model once: one call per module.
    assert calls == {"rms_norm": norms, "swiglu": mlps}, (calls, norms, mlps)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
