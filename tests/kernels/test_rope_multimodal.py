"""Vision RoPE (``rope_vision/full``, packed ``[S, H, D]``) and M-RoPE (``rope/mrope``) against HF's formulas, on the
Triton interpreter on CPU (small shapes) and on CUDA at real shapes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb as hf_apply_rope
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision as hf_vision_rope

from veomni.kernels.rope.multimodal import apply_mrope_eager, apply_rope_vision_eager, mrope_select

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton():
    from veomni.kernels.rope import multimodal_triton

    return multimodal_triton


def _vision_inputs(s, hq, hk, d, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # The tower's fused qkv projection: q and k are strided views of one [S, 3, H, D] buffer.
    qkv = torch.randn(s, 3, hq, d, generator=gen).to(device, dtype)
    q, k = qkv[:, 0], qkv[:, 1, :hk]
    angles = torch.randn(s, d // 2, generator=gen).to(device) * 3
    emb = torch.cat([angles, angles], -1)
    return q, k, emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_eager_is_hf_and_triton_matches(dtype):
    q, k, cos, sin = _vision_inputs(37, 4, 4, 16, dtype)
    want = hf_vision_rope(q, k, cos, sin)
    got = apply_rope_vision_eager(q, k, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    q_t, k_t = _triton().apply_rope_vision_triton(q, k, cos, sin)
    assert q_t.shape == q.shape and q_t.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # both round once from fp32; FMA order may differ
    torch.testing.assert_close(q_t, want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(k_t, want[1], rtol=tol, atol=tol)


def test_vision_gradients_match_eager():
    q, k, cos, sin = _vision_inputs(11, 2, 2, 8, torch.float32)
    grads = []
    for fn in (apply_rope_vision_eager, _triton().apply_rope_vision_triton):
        qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        out_q, out_k = fn(qq, kk, cos, sin)
        (out_q * torch.arange(out_q.numel()).view_as(out_q).sin() + out_k.square()).sum().backward()
        grads.append((qq.grad, kk.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_vision_bad_inputs_raise():
    q, k, cos, sin = _vision_inputs(5, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"q and k must be \[S, H, D\]"):
        apply_rope_vision_eager(q.unsqueeze(0), k, cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must be \[S, D\] = \(5, 8\); got \(5, 4\)"):
        apply_rope_vision_eager(q, k, cos[:, :4], sin)


def _mrope_inputs(b, s, hq, hk, d, section, dtype, device=DEVICE):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, hq, s, d, generator=gen).to(device, dtype)
    k = torch.randn(b, hk, s, d, generator=gen).to(device, dtype)
    positions = torch.randint(0, 50, (3, b, s), generator=gen).to(device)
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = positions[..., None].float() * inv_freq  # [3, B, S, D/2]
    emb = torch.cat([freqs, freqs], -1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype), positions, inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_equals_hf_qwen2_vl(dtype):
    section = [4, 6, 6]
    q, k, cos, sin, positions, inv_freq = _mrope_inputs(2, 9, 4, 2, 32, section, dtype)
    # HF (Qwen2-VL): the rotary module recomposes the three tables by section, then the text formula.
    rotary = Qwen2VLRotaryEmbedding.__new__(Qwen2VLRotaryEmbedding)
    rotary.mrope_section = section
    freqs = positions[..., None].float() * inv_freq
    hf_cos = rotary.recomposition_frequencies(freqs.cos()).to(dtype)
    hf_sin = rotary.recomposition_frequencies(freqs.sin()).to(dtype)
    want = hf_apply_rope(q, k, hf_cos, hf_sin)
    got = apply_mrope_eager(q, k, cos, sin, mrope_section=section)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    got_t = _triton().apply_mrope_triton(q, k, cos, sin, mrope_section=section)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got_t, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_mrope_section_errors_and_selection():
    q, k, cos, sin, *_ = _mrope_inputs(1, 3, 2, 2, 8, [1, 1, 2], torch.float32)
    with pytest.raises(
        ValueError, match=r"mrope_section must be 3 ints >= 0 summing to D/2 = 4; got \[2, 2, 2\]"
    ):
        apply_mrope_eager(q, k, cos, sin, mrope_section=[2, 2, 2])
    with pytest.raises(ValueError, match=r"cos and sin must be \[3, B, S, D\]"):
        apply_mrope_eager(q, k, cos[0], sin[0], mrope_section=[1, 1, 2])
    marked = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 3, 8)
    picked, _ = mrope_select(marked, marked, [1, 1, 2])
    assert picked[0, 0].tolist() == [0, 1, 2, 2, 0, 1, 2, 2]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cuda_real_shapes(dtype):
    # Qwen2.5-VL / Qwen3-VL towers: 16 heads of 80 dims, ~16k patches; Qwen2-VL-7B text: 28/4 heads of 128.
    q, k, cos, sin = _vision_inputs(16_384, 16, 16, 80, dtype, device="cuda")
    want = hf_vision_rope(q, k, cos, sin)
    for a, b in zip(_triton().apply_rope_vision_triton(q, k, cos, sin), want, strict=True):
        torch.testing.assert_close(a, b, rtol=8e-3, atol=8e-3)
    q, k, cos, sin, *_ = _mrope_inputs(2, 4096, 28, 4, 128, [16, 24, 24], dtype, device="cuda")
    want = apply_mrope_eager(q, k, cos, sin, mrope_section=[16, 24, 24])
    for a, b in zip(
        _triton().apply_mrope_triton(q, k, cos, sin, mrope_section=[16, 24, 24]), want, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
