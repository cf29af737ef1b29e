"""MoE experts with per-expert LoRA adapters on the fused projections, applied inside the grouped-GEMM path.

Each expert ``e`` of HF's fused SwiGLU experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) may carry a
low-rank update on either projection, ``W[e] + scaling * B[e] @ A[e]``, which is never formed: the rows of expert
``e`` go through the base GEMM and through the two thin GEMMs of the adapter, and the two are summed before the
activation (gate_up) or before the combine (down)::

    gu = x @ W1[e]^T + scaling * (x @ A1[e]^T) @ B1[e]^T        A1 [E, r, H], B1 [E, 2I, r]
    h  = silu(gu[:, :I]) * gu[:, I:]
    y  = h @ W2[e]^T + scaling * (h @ A2[e]^T) @ B2[e]^T         A2 [E, r, I], B2 [E, H, r]

An adapter pair may be absent (None, None): that projection is the base one. The branch runs in the adapters'
dtype (as `veomni.models.lora.layers.LoraLinear` and PEFT do: fp32 adapters on a bf16 base compute it in fp32) and
is added rounded to the activations' dtype.

Registry variants of ``moe_experts``: ``lora_routed`` ``fn(hidden [T, H], top_k_index [T, k], top_k_weights [T, k],
gate_up_proj, down_proj, gate_up_A, gate_up_B, down_A, down_B, *, scaling) -> [T, H]`` and ``lora_grouped``
``fn(x [N, H], tokens_per_expert [E], gate_up_proj, down_proj, gate_up_A, gate_up_B, down_A, down_B, *, scaling)
-> [N, H]`` (rows grouped by expert, as expert-parallel dispatch returns them). Backends: ``eager`` (a loop over
experts, the oracle) and ``torch`` (``torch._grouped_mm`` for the base and the adapter GEMMs). The triton backend has
no LoRA variants: its gate_up GEMM fuses SwiGLU into the epilogue, before an adapter could add its update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from veomni.kernels.moe_experts.common import (
    check_grouped_inputs,
    check_routed_inputs,
    expert_major_order,
    group_offsets,
    inverse_permutation,
)

# (gate_up_A [E, r, H], gate_up_B [E, 2I, r], down_A [E, r, I], down_B [E, H, r]); a pair may be (None, None).
Adapters = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def check_adapters(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, adapters: Adapters, scaling: float
) -> int:
    """Validate the adapters against the (already checked) expert weights; returns the rank ``r``.

    Raises:
        ValueError: half a pair, no pair at all, shapes off the layout in the module doc, ranks that differ, a
            non-positive or non-numeric ``scaling``, or adapters on another device than the weights.
        TypeError: adapters of two dtypes, or not floating point.
    """
    experts, two_i, hidden = gate_up_proj.shape
    inter = down_proj.shape[2]
    if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not scaling > 0:
        raise ValueError(f"moe_experts lora: scaling must be a positive number, got {scaling!r}")
    pairs = {
        "gate_up": (adapters[0], adapters[1], hidden, two_i),
        "down": (adapters[2], adapters[3], inter, hidden),
    }
    ranks, dtypes = set(), set()
    for name, (a, b, fan_in, fan_out) in pairs.items():
        if (a is None) != (b is None):
            raise ValueError(f"moe_experts lora: {name}_A and {name}_B come together; got only one of them")
        if a is None or b is None:
            continue
        rank = a.shape[1] if a.dim() == 3 else -1
        if (
            tuple(a.shape) != (experts, rank, fan_in)
            or tuple(b.shape) != (experts, fan_out, rank)
            or rank < 1
        ):
            raise ValueError(
                f"moe_experts lora: {name}_A must be [E, r, in] = [{experts}, r, {fan_in}] and {name}_B [E, out, r] "
                f"= [{experts}, {fan_out}, r]; got {tuple(a.shape)} and {tuple(b.shape)}"
            )
        for t in (a, b):
            if t.device != gate_up_proj.device:
                raise ValueError(
                    f"moe_experts lora: {name} adapters are on {t.device}, the expert weights on {gate_up_proj.device}"
                )
            if not t.is_floating_point():
                raise TypeError(f"moe_experts lora: adapters must be floating point, got {t.dtype}")
            dtypes.add(t.dtype)
        ranks.add(rank)
    if not ranks:
        raise ValueError("moe_experts lora: no adapter given (gate_up_A/B and down_A/B are all None)")
    if len(ranks) > 1 or len(dtypes) > 1:
        raise ValueError(
            f"moe_experts lora: the adapters must share one rank and dtype; got {ranks} and {dtypes}"
        )
    return ranks.pop()


# ---- eager: the oracle -------------------------------------------------------------------------------------


def _branch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    # In the adapters' dtype, added rounded to the activations' (LoraLinear's rounding).
    return (F.linear(F.linear(x.to(a.dtype), a), b) * scaling).to(x.dtype)


def _expert(rows: torch.Tensor, params: tuple[torch.Tensor | None, ...], scaling: float) -> torch.Tensor:
    w1, w2, a1, b1, a2, b2 = params
    assert w1 is not None and w2 is not None
    gate_up = F.linear(rows, w1)
    if a1 is not None and b1 is not None:
        gate_up = gate_up + _branch(rows, a1, b1, scaling)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    out = F.linear(h, w2)
    if a2 is not None and b2 is not None:
        out = out + _branch(h, a2, b2, scaling)
    return out


def _expert_params(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, adapters: Adapters, e: int
) -> tuple[torch.Tensor | None, ...]:
    return (gate_up_proj[e], down_proj[e], *(t[e] if t is not None else None for t in adapters))


def moe_experts_lora_grouped_eager(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_A: torch.Tensor | None,
    gate_up_B: torch.Tensor | None,
    down_A: torch.Tensor | None,
    down_B: torch.Tensor | None,
    *,
    scaling: float,
) -> torch.Tensor:
    """Each expert, adapters included (module doc), on its contiguous run of rows; syncs to read the counts.

    Args:
        x: ``[N, H]`` rows grouped by expert. tokens_per_expert: ``[E]`` int32/int64 on x's device.
        gate_up_proj: ``[E, 2I, H]``; down_proj: ``[E, H, I]`` (x's dtype).
        gate_up_A, gate_up_B, down_A, down_B: the adapters (module doc), one dtype; a pair may be None.
        scaling: the factor on ``B @ A``.
    Returns:
        ``[N, H]`` in x's dtype; differentiable w.r.t. x, the weights and the adapters.
    """
    adapters = (gate_up_A, gate_up_B, down_A, down_B)
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    check_adapters(gate_up_proj, down_proj, adapters, scaling)
    rows = torch.split(x, tokens_per_expert.tolist())
    return torch.cat(
        [
            _expert(r, _expert_params(gate_up_proj, down_proj, adapters, e), scaling)
            for e, r in enumerate(rows)
        ]
    )


def moe_experts_lora_routed_eager(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_A: torch.Tensor | None,
    gate_up_B: torch.Tensor | None,
    down_A: torch.Tensor | None,
    down_B: torch.Tensor | None,
    *,
    scaling: float,
) -> torch.Tensor:
    """Each token through its ``k`` adapted experts, ``sum_j w[t, j] * y[t, j]`` accumulated in fp32.

    Args:
        hidden: ``[T, H]``. top_k_index: ``[T, k]`` int64 ids in ``[0, E)``. top_k_weights: ``[T, k]`` float.
        gate_up_proj, down_proj, gate_up_A, gate_up_B, down_A, down_B, scaling: as `moe_experts_lora_grouped_eager`.
    Returns:
        ``[T, H]`` in hidden's dtype.
    """
    adapters = (gate_up_A, gate_up_B, down_A, down_B)
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    check_adapters(gate_up_proj, down_proj, adapters, scaling)
    tokens, top_k = top_k_index.shape
    acc = torch.promote_types(hidden.dtype, torch.float32)
    flat_ids = top_k_index.reshape(-1)
    rows = hidden.new_zeros(tokens * top_k, hidden.shape[1], dtype=acc)
    for expert in range(gate_up_proj.shape[0]):
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        params = _expert_params(gate_up_proj, down_proj, adapters, expert)
        rows = rows.index_put((pairs,), _expert(hidden[pairs // top_k], params, scaling).to(acc))
    combined = (rows.view(tokens, top_k, rows.shape[1]) * top_k_weights.to(acc).unsqueeze(-1)).sum(1)
    return combined.to(hidden.dtype)


# ---- torch._grouped_mm -------------------------------------------------------------------------------------


def _padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A [E, r, in]`` / ``B [E, out, r]`` with ``r`` zero-padded to a 16-byte multiple: ``torch._grouped_mm`` needs
    16-byte strides on every operand, and ``r`` is the row length of ``x @ A^T`` and a stride of both factors. The
    padded rows of A and columns of B are zeros, so the product is unchanged (and their gradients are dropped)."""
    per_16 = 16 // a.element_size()
    pad = -a.shape[1] % per_16
    if pad == 0:
        return a, b
    return F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))


def _torch_branch(
    x: torch.Tensor, ends: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    from veomni.kernels.moe_experts.torch_impl import _GroupedMM

    a, b = _padded(a, b)
    low: torch.Tensor = _GroupedMM.apply(x.to(a.dtype), ends, a)  # [N, r]
    high: torch.Tensor = _GroupedMM.apply(low, ends, b)
    return (high * scaling).to(x.dtype)


def _torch_rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    adapters: Adapters,
    scaling: float,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`veomni.kernels.moe_experts.torch_impl.run_experts` with the adapter GEMMs added: ``[N, H]`` expert-major rows
    (group ``offsets [E + 1]``) -> ``[N, H]``; ``row_weights [N]`` scale each row before the down GEMMs."""
    from veomni.kernels.moe_experts.torch_impl import _GroupedMM

    a1, b1, a2, b2 = adapters
    ends = offsets[1:]
    gate_up: torch.Tensor = _GroupedMM.apply(x, ends, gate_up_proj)
    if a1 is not None and b1 is not None:
        gate_up = gate_up + _torch_branch(x, ends, a1, b1, scaling)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    if row_weights is not None:
        # Linear in h: the routing weight scales the base and the adapter term alike (as torch_impl does).
        h = h * row_weights.to(h.dtype).unsqueeze(-1)
    out: torch.Tensor = _GroupedMM.apply(h, ends, down_proj)
    if a2 is not None and b2 is not None:
        out = out + _torch_branch(h, ends, a2, b2, scaling)
    return out


def moe_experts_lora_grouped_torch(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_A: torch.Tensor | None,
    gate_up_B: torch.Tensor | None,
    down_A: torch.Tensor | None,
    down_B: torch.Tensor | None,
    *,
    scaling: float,
) -> torch.Tensor:
    """`moe_experts_lora_grouped_eager` on ``torch._grouped_mm`` (devices and dtypes: see torch_impl; fp32 adapters
    on CUDA take torch's per-expert fallback, which syncs with the host per GEMM: keep them in bf16 there)."""
    from veomni.kernels.moe_experts.torch_impl import _check_layout

    adapters = (gate_up_A, gate_up_B, down_A, down_B)
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    check_adapters(gate_up_proj, down_proj, adapters, scaling)
    _check_layout(x, gate_up_proj)
    return _torch_rows(x, group_offsets(tokens_per_expert), gate_up_proj, down_proj, adapters, scaling)


def moe_experts_lora_routed_torch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_A: torch.Tensor | None,
    gate_up_B: torch.Tensor | None,
    down_A: torch.Tensor | None,
    down_B: torch.Tensor | None,
    *,
    scaling: float,
) -> torch.Tensor:
    """`moe_experts_lora_routed_eager` on ``torch._grouped_mm``: the rows are permuted expert-major once, and the
    base and adapter GEMMs of both projections run on them (no per-expert loop, no host sync on CUTLASS)."""
    from veomni.kernels.moe_experts.torch_impl import _check_layout, gather_rows

    adapters = (gate_up_A, gate_up_B, down_A, down_B)
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    check_adapters(gate_up_proj, down_proj, adapters, scaling)
    _check_layout(hidden, gate_up_proj)
    tokens, top_k = top_k_index.shape
    order, offsets = expert_major_order(top_k_index, gate_up_proj.shape[0])
    unsort = inverse_permutation(order)
    x = gather_rows(hidden, order // top_k, unsort, top_k)
    row_weights = top_k_weights.reshape(-1)[order]
    y = _torch_rows(x, offsets, gate_up_proj, down_proj, adapters, scaling, row_weights)
    rows = gather_rows(y, unsort, order, 1).view(tokens, top_k, y.shape[1])
    return rows.sum(1)


__all__ = [
    "check_adapters",
    "moe_experts_lora_grouped_eager",
    "moe_experts_lora_grouped_torch",
    "moe_experts_lora_routed_eager",
    "moe_experts_lora_routed_torch",
]
