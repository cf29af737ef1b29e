"""The ``npu`` backend: Ascend NPU kernels from torch_npu behind veomni's plain-function signatures.

Imported only when a config selects ``npu`` (the registry requires an NPU and the ``torch_npu`` package), so this
module imports torch_npu at the top. Nothing here runs on this project's CPU/GPU CI: the numeric parity tests are
marked ``npu`` (tests/kernels/test_npu_backend.py) and run on an Ascend runner (docs/kernels.md).

- RMSNorm: ``torch_npu.npu_rms_norm`` (fp32 statistics inside the kernel; the result is rounded once, so the
  ``standard`` variant can differ from the eager cast-then-scale order by one ulp of the input dtype);
  ``offset`` passes ``1 + w`` computed in fp32; ``residual`` uses ``npu_add_rms_norm``.
- RoPE: ``torch_npu.npu_rotary_mul`` on the rotated dims (rotate-half layout, as HF).
- Attention: ``torch_npu.npu_fusion_attention``; packed rows (``cu_seqlens``) run in its ``TND`` layout, whose
  ``actual_seq_qlen`` must be a host list: one device-to-host copy of ``cu_seqlens`` per call (the NPU API needs
  it; the trainer's collator already has the lengths on the host).
- MoE experts: ``torch_npu.npu_grouped_matmul`` for the forward, dgrad (split-M) and wgrad (split-K) GEMMs,
  with the routing/permutation of the ``torch`` backend (`veomni.kernels.moe_experts.torch_impl`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch_npu

from veomni.kernels.attention.features import check_features
from veomni.kernels.attention.functions import check_qkv
from veomni.kernels.moe_experts import torch_impl
from veomni.kernels.moe_experts.common import check_grouped_inputs, check_routed_inputs, group_offsets
from veomni.kernels.rms_norm.eager import check_inputs as check_norm_inputs
from veomni.kernels.rope.eager import check_rope_inputs
from veomni.kernels.rope.multimodal import check_vision_inputs, mrope_select

# npu_fusion_attention's causal mode (sparse_mode=3, "rightDownCausal") takes this fixed 2048 x 2048 upper-triangle
# mask whatever the sequence length; True marks a masked-out pair.
_CAUSAL_MASK_SIZE = 2048
_SPARSE_NONE, _SPARSE_CAUSAL = 0, 3


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm on ``npu_rms_norm``. ``x [..., H]``, ``weight [H]``; returns ``[..., H]``."""
    check_norm_inputs(x, weight, eps)
    result: torch.Tensor = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    return result


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight)`` RMSNorm, all in fp32 then cast (as the eager ``offset`` oracle). Returns x's dtype."""
    check_norm_inputs(x, weight, eps)
    out: torch.Tensor = torch_npu.npu_rms_norm(x.float(), 1.0 + weight.float(), epsilon=eps)[0]
    return out.to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (a ones gamma). ``x [..., H]``; returns x's dtype."""
    check_norm_inputs(x, None, eps)
    result: torch.Tensor = torch_npu.npu_rms_norm(x, x.new_ones(x.shape[-1]), epsilon=eps)[0]
    return result


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_standard(x + residual), x + residual)`` on ``npu_add_rms_norm``. All ``[..., H]``."""
    check_norm_inputs(x, weight, eps, residual)
    y, _, new_residual = torch_npu.npu_add_rms_norm(x, residual, weight.to(x.dtype), epsilon=eps)
    return y, new_residual


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        result: torch.Tensor = torch_npu.npu_rotary_mul(x, cos, sin)
        return result
    rotated = torch_npu.npu_rotary_mul(x[..., :rotary_dim].contiguous(), cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rotary_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on ``npu_rotary_mul``: q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, cos/sin ``[B|1, S, R]``
    or ``[S, R]``. Returns ``(q_out, k_out)`` shaped and typed as q and k."""
    rotary_dim = check_rope_inputs(q, k, cos, sin, rotary_dim)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    # [B, S, R] -> [B, 1, S, R]: broadcast over heads, the layout npu_rotary_mul takes for BNSD inputs.
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return _rotary(q, cos, sin, rotary_dim), _rotary(k, cos, sin, rotary_dim)


def apply_mrope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, mrope_section: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE: the section selection (`mrope_select`) then `apply_rope`; q ``[B, Hq, S, D]``, cos ``[3, B, S, D]``."""
    cos3, sin3 = mrope_select(cos, sin, mrope_section)
    return apply_rope(q, k, cos3, sin3)


def apply_rope_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rotary on ``npu_rotary_mul`` in fp32 (HF's vision formula): ``q [S, Hq, D]``, ``k [S, Hk, D]``,
    ``cos/sin [S, D]``. Returns rotated q, k in their dtypes."""
    check_vision_inputs(q, k, cos, sin)
    # [S, H, D] -> [1, S, H, D] with cos [1, S, 1, D]: the BSND broadcast npu_rotary_mul accepts.
    c, s = cos.float()[None, :, None], sin.float()[None, :, None]
    q_out = torch_npu.npu_rotary_mul(q.float().unsqueeze(0), c, s)[0]
    k_out = torch_npu.npu_rotary_mul(k.float().unsqueeze(0), c, s)[0]
    return q_out.to(q.dtype), k_out.to(k.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``npu_fusion_attention``: q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` (GQA allowed), optional int32
    ``cu_seqlens [n + 1]`` with ``B == 1`` (packed rows, ``TND`` layout). Returns ``[B, S, Hq, D]`` in q's dtype.
    No optional features (window, sinks, soft-cap): the registry declares none, so models needing one are refused.
    """
    check_qkv(q, k, v, cu_seqlens, causal=causal)
    check_features("npu", q, causal, window, sinks, softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = None
    sparse_mode = _SPARSE_NONE
    if causal:
        mask = torch.ones(_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE, dtype=torch.bool, device=q.device).triu_(1)
        sparse_mode = _SPARSE_CAUSAL
    heads = q.shape[2]
    if cu_seqlens is None:
        result: torch.Tensor = torch_npu.npu_fusion_attention(
            q, k, v, heads, "BSND", atten_mask=mask, scale=scale, sparse_mode=sparse_mode
        )[0]
        return result
    # TND wants cumulative end offsets without the leading 0, on the host.
    ends = cu_seqlens[1:].tolist()
    out: torch.Tensor = torch_npu.npu_fusion_attention(
        q[0], k[0], v[0], heads, "TND", atten_mask=mask, scale=scale, sparse_mode=sparse_mode,
        actual_seq_qlen=ends, actual_seq_kvlen=ends,
    )[0]  # fmt: skip
    return out.unsqueeze(0)


def _gmm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, group_type: int) -> torch.Tensor:
    # split_item=3: one output tensor; group_list_type=0: cumulative group ends (int64).
    result: torch.Tensor = torch_npu.npu_grouped_matmul(
        [x], [w], group_list=ends.to(torch.int64), split_item=3, group_type=group_type, group_list_type=0
    )[0]
    return result


class _NpuGroupedMM(torch.autograd.Function):
    """``x [N, K]`` (expert-major) times ``w[e]^T`` (``w [E, n_out, K]``) per group; ``ends [E]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends, w)
        return _gmm(x, w.transpose(-2, -1), ends, group_type=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        x, ends, w = ctx.saved_tensors
        need_x, _, need_w = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = _gmm(grad, w, ends, group_type=0) if need_x else None
        # Split-K form (group_type=2): per expert e, grad_e^T @ x_e -> [E, n_out, K].
        grad_w = _gmm(grad.t().contiguous(), x, ends, group_type=2) if need_w else None
        return grad_x, None, grad_w


def moe_experts_grouped(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """`moe_experts_grouped_eager`'s contract on ``npu_grouped_matmul``: x ``[N, H]`` expert-major,
    tokens_per_expert ``[E]``, gate_up_proj ``[E, 2I, H]``, down_proj ``[E, H, I]``. Returns ``[N, H]``."""
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    return torch_impl.run_experts(
        x, group_offsets(tokens_per_expert), gate_up_proj, down_proj, mm=_NpuGroupedMM.apply
    )


def moe_experts_routed(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts_routed_eager`'s contract on ``npu_grouped_matmul``: hidden ``[T, H]``, top_k_index ``[T, k]``
    int64, top_k_weights ``[T, k]``, weights as in `moe_experts_grouped`. Returns ``[T, H]``."""
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    return torch_impl.route_experts(
        hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, mm=_NpuGroupedMM.apply
    )
