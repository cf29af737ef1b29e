"""Fused linear cross-entropy: chunked cuBLAS GEMMs plus one Triton pass per chunk; never a ``[T, V]`` tensor.

Named ``triton_impl`` rather than ``triton`` so that nothing mistakes this file for the ``triton`` package.

Per chunk of ``C`` tokens (gradients are computed during forward; backward only scales them):

1. ``Z = X_c @ W^T`` (cuBLAS, input dtype, fp32 accumulation) into one reused ``[C, V]`` buffer;
2. one Triton pass per row (a program per row by default): fp32 log-sum-exp over the row (soft-capped if asked),
   the row's loss, then the row's logit gradient ``softmax - onehot + 2 z lse softmax`` (times the soft-cap derivative) written back over
   ``Z`` in place; ignored rows skip the maths and write zeros;
3. ``dX_c = G @ W`` (cuBLAS, straight into the rows of dX);
4. ``dW += G^T @ X_c`` in fp32 (cuBLAS ``addmm`` with ``out_dtype=float32`` on CUDA).

The fp32 dW accumulator would need ``V·H·4`` bytes next to the ``V·H·2``-byte half-precision result. Instead the
result buffer itself holds the fp32 partial sums of the first ``n0 ≈ V/2`` rows (``n0`` fp32 rows fill exactly
the bytes of ``2·n0`` half rows) and a separate fp32 buffer holds the rest. Backward scales by ``grad_output``
and rounds to half precision once, front to back: each block of rows is no longer than its start row, so its
half-precision rows land only on bytes whose fp32 rows were already converted. Net extra memory for dW is
``V·H·2`` bytes, not ``V·H·4``, and every dW element is rounded once, from its fp32 sum.

Precision: as in HF's eager path, logits are the GEMM's output rounded to the input dtype, and everything after is
fp32 (LSE, softmax, loss); the logit gradient is rounded to the input dtype for the dX/dW GEMMs, which accumulate
in fp32. dX is rounded twice (GEMM output, then the ``grad_output`` scale), dW once.

No host syncs: no ``.item()``, no data-dependent Python branches, no boolean indexing. Labels outside
``[0, V)`` (other than ``ignore_index``) make the loss NaN instead of raising, because checking them on the host
would sync. Results are deterministic run to run (fixed chunking, no atomics, cuBLAS in one stream).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from veomni.kernels.cross_entropy.chunked import mixed_addmm_supported
from veomni.kernels.cross_entropy.eager import IGNORE_INDEX, check_inputs

__all__ = ["LaunchConfig", "causal_lm_cross_entropy", "default_config", "linear_cross_entropy",
           "sequence_classification_cross_entropy"]  # fmt: skip


class LaunchConfig(NamedTuple):
    """How the work is cut: ``chunk_tokens`` rows per GEMM chunk (the logits buffer holds that many rows of V),
    ``block_v`` columns per step of the row kernel, its ``num_warps``, and ``programs_per_sm`` (0: one program
    per row; otherwise that many programs per SM, each walking rows)."""

    chunk_tokens: int
    block_v: int
    num_warps: int
    programs_per_sm: int = 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # the interpreter: a small odd grid, so tests see programs walking several rows


def _programs(cfg: LaunchConfig, rows: int, device: torch.device) -> int:
    if cfg.programs_per_sm <= 0:
        return rows
    return max(1, min(rows, cfg.programs_per_sm * _sm_count(device)))


# Rows the logits buffer may hold at most: past this the dW GEMM (K = chunk_tokens) is long enough to be
# compute-bound, so a bigger buffer buys no speed, only memory.
MAX_CHUNK_TOKENS = 2048
# Size of the logits buffer allowed before the chunk shrinks (at V = 151,936 bf16: 2048 rows = 594 MiB).
LOGITS_BUDGET_BYTES = 640 * 2**20


def default_config(n_tokens: int, vocab: int, itemsize: int) -> LaunchConfig:
    """The chunking used unless a caller passes its own (see notebook/benchmarks-log.md for the measurements)."""
    rows = max(128, min(MAX_CHUNK_TOKENS, LOGITS_BUDGET_BYTES // max(1, vocab * itemsize)) // 128 * 128)
    block_v = min(8192, triton.next_power_of_2(max(vocab, 16)))
    warps = max(1, min(16, block_v // 256))
    return LaunchConfig(chunk_tokens=max(1, min(n_tokens, rows)), block_v=block_v, num_warps=warps)


@triton.jit
def _tanh(x):
    # tanh from exp2 (portable to the interpreter); symmetric form never overflows.
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _ce_row(z_row, label, loss_ptr, n_cols, ignore_index, softcap, z_weight,
            HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, BLOCK)
    if label != ignore_index:
        # Pass 1: online log-sum-exp in base 2, one block max and one exp2 per element.
        m = float("-inf")
        s = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            inside = offs < n_cols
            x = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                x = softcap * _tanh(x / softcap)
            x = tl.where(inside, x * 1.4426950408889634, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
            m = m_new
        lse2 = m + tl.log2(s)
        lse = lse2 * 0.6931471805599453
        in_range = (label >= 0) & (label < n_cols)
        z_label = tl.load(z_row + tl.minimum(tl.maximum(label, 0), n_cols - 1)).to(tl.float32)
        if HAS_SOFTCAP:
            z_label = softcap * _tanh(z_label / softcap)
        loss = lse - z_label + z_weight * lse * lse
        tl.store(loss_ptr, tl.where(in_range, loss, float("nan")))
        if WRITE_GRAD:
            # Pass 2: d(loss)/dz = (softmax - onehot) + softmax * 2 z_weight lse, through the soft-cap if any.
            # In this order softmax - 1 at the label is exact (Sterbenz) when softmax is near 1.
            zc = 2.0 * z_weight * lse
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                inside = offs < n_cols
                x = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    t = _tanh(x / softcap)
                    x = softcap * t
                p = tl.exp2(x * 1.4426950408889634 - lse2)
                g = (p - tl.where(offs == label, 1.0, 0.0)) + p * zc
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                tl.store(z_row + offs, g.to(z_row.dtype.element_ty), mask=inside)
    else:
        tl.store(loss_ptr, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=z_row.dtype.element_ty)
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                tl.store(z_row + offs, zeros, mask=offs < n_cols)


# fmt: off
@triton.jit
def _ce_rows_kernel(Z, LABELS, LOSS, z_stride, n_rows, n_cols, ignore_index, softcap, z_weight,
                    HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # fmt: on
    # A program walks rows pid, pid + programs, ... With programs_per_sm > 0 the grid is small, meant to keep the
    # rows in flight within L2 for pass 2; on an H100 that measured no faster than a program per row (the
    # default; notebook/benchmarks-log.md 2026-11-21).
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for i in range(0, tl.cdiv(n_rows - pid, programs)):
        row64 = (pid + i * programs).to(tl.int64)
        _ce_row(Z + row64 * z_stride, tl.load(LABELS + row64), LOSS + row64, n_cols, ignore_index, softcap,
                z_weight, HAS_SOFTCAP, WRITE_GRAD, BLOCK)  # fmt: skip


@triton.jit
def _scale_copy_kernel(SRC, DST, G, n, BLOCK: tl.constexpr):
    # DST = SRC * g in fp32, rounded once to DST's dtype; SRC may be DST (each element is read before written).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G)
    x = tl.load(SRC + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DST + offs, (x * g).to(DST.dtype.element_ty), mask=mask)


def _scale_copy(src: torch.Tensor, dst: torch.Tensor, g: torch.Tensor) -> None:
    n = src.numel()
    if n:
        block = 4096
        _scale_copy_kernel[(triton.cdiv(n, block),)](src, dst, g, n, BLOCK=block, num_warps=8)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) a @ b`` with fp32 accumulation and a single fp32 result, whatever a/b's dtype."""
    beta = 0 if first else 1  # beta = 0: acc is not read, so its uninitialised contents cannot leak in
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif acc.device.type == "cuda" and mixed_addmm_supported(acc.device):
        torch.addmm(acc, a, b, torch.float32, beta=beta, out=acc)
    elif acc.device.type == "cuda":
        # Same sums, more traffic: fp32 products of row blocks, then added (blocks bound the temporary).
        for r0 in range(0, acc.shape[0], _FALLBACK_ROWS):
            part = torch.mm(a[r0 : r0 + _FALLBACK_ROWS], b, out_dtype=torch.float32)
            if first:
                acc[r0 : r0 + _FALLBACK_ROWS].copy_(part)
            else:
                acc[r0 : r0 + _FALLBACK_ROWS].add_(part)
    else:
        # CPU has no mixed-dtype addmm; products of half values are exact in fp32, so this is the same sum.
        torch.addmm(acc, a.float(), b.float(), beta=beta, out=acc)


_FALLBACK_ROWS = 16384


class _WeightGrad:
    """fp32 accumulation of ``sum_c G_c^T X_c`` for a ``[V, H]`` weight, finished once into its dtype.

    For half-precision weights the result buffer hosts the fp32 sums of rows ``[0, n0)`` (see module doc).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        vocab, hidden = weight.shape
        self.out = torch.empty((vocab, hidden), dtype=weight.dtype, device=weight.device)
        self.started = False
        if weight.dtype == torch.float32:
            self.n0, self.parts = vocab, [(0, vocab, self.out)]
            return
        # n0 a multiple of 8 keeps the second GEMM's operand (a column slice of G) 16-byte aligned.
        self.n0 = (vocab // 2) // 8 * 8
        acc_a = self.out.view(-1)[: 2 * self.n0 * hidden].view(torch.float32).view(self.n0, hidden)
        acc_b = torch.empty((vocab - self.n0, hidden), dtype=torch.float32, device=weight.device)
        self.parts = [p for p in ((0, self.n0, acc_a), (self.n0, vocab, acc_b)) if p[1] > p[0]]

    def add(self, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        for lo, hi, acc in self.parts:
            _accumulate(acc, grad_logits[:, lo:hi].t(), x, first=not self.started)
        self.started = True

    def finish(self, g: torch.Tensor) -> torch.Tensor:
        """Scale by ``g`` (0-d fp32) and round once into the weight's dtype; the accumulators are consumed."""
        out, parts = self.out, self.parts
        self.parts = []
        if not self.started:
            return out.zero_()
        if out.dtype == torch.float32:
            _scale_copy(out, out, g)
            return out
        for lo, hi, acc in parts:
            if lo == 0:
                # First block through a small temporary (its half rows overlap its own fp32 rows); after that
                # every block [i0, i1) has i1 <= 2*i0, so it overwrites only fp32 rows < i0, already converted.
                head = min(hi, 256)
                tmp = torch.empty((head, out.shape[1]), dtype=out.dtype, device=out.device)
                _scale_copy(acc[:head], tmp, g)
                out[:head].copy_(tmp)
                i0 = head
                while i0 < hi:
                    i1 = min(hi, 2 * i0)
                    _scale_copy(acc[i0:i1], out[i0:i1], g)
                    i0 = i1
            else:
                _scale_copy(acc, out[lo:hi], g)
        return out


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"cross_entropy (triton): tensors are on {t.device}; the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 to run it on the CPU through Triton's interpreter)"
        )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        z_weight: float,
        cfg: LaunchConfig,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # needs_input_grad ignores torch.no_grad(); the caller's grad mode says whether anyone can ask.
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        x = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        if y.stride(0) != 1:
            y = y.contiguous()
        n_tokens, vocab = x.shape[0], weight.shape[0]
        losses = torch.empty(n_tokens, dtype=torch.float32, device=x.device)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
        dw = _WeightGrad(weight) if need_dw else None
        chunk = max(1, min(cfg.chunk_tokens, n_tokens))
        buf = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if n_tokens else None
        w_t = weight.t()
        for start in range(0, n_tokens, chunk):
            stop = min(start + chunk, n_tokens)
            assert buf is not None  # allocated whenever there are tokens
            x_c, z = x[start:stop], buf[: stop - start]
            torch.mm(x_c, w_t, out=z)
            # fmt: off
            _ce_rows_kernel[(_programs(cfg, stop - start, x.device),)](
                z, y[start:], losses[start:], z.stride(0), stop - start, vocab, ignore_index,
                float(softcap) if softcap is not None else 1.0, float(z_weight),
                HAS_SOFTCAP=softcap is not None, WRITE_GRAD=need_dx or need_dw, BLOCK=cfg.block_v,
                num_warps=cfg.num_warps,
            )
            # fmt: on
            if dx is not None:  # need_dx
                torch.mm(z, weight, out=dx[start:stop])
            if dw is not None:  # need_dw
                dw.add(z, x_c)
        ctx.hidden_shape = hidden.shape
        ctx.grads = (dx, dw)
        return losses.sum()

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "cross_entropy (triton) computes its gradients in forward and hands them out once; a second "
                "backward through the same call (retain_graph=True) is not supported"
            )
        # Drop ctx's references first: autograd then adopts the returned tensors as .grad without a copy.
        ctx.grads = None
        dx, dw = grads
        g = grad_loss.detach().to(torch.float32).reshape(()).contiguous()
        grad_hidden = grad_weight = None
        if dx is not None:
            _scale_copy(dx, dx, g)
            grad_hidden = dx.view(ctx.hidden_shape)
        if dw is not None:
            grad_weight = dw.finish(g)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
    config: LaunchConfig | None = None,
    variant: str = "causal",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused LM-head + cross-entropy with an explicit launch config (the registry functions use the default).

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32; weight: ``[V, H]`` same dtype; labels: ``[...]`` int64.
        config: chunking and launch shape; ``default_config(...)`` when None.
    Returns:
        ``(loss_sum, valid_count)``: 0-d fp32 and 0-d int64 (see ``eager.causal_lm_cross_entropy``).
    """
    check_inputs(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant=variant,
    )  # fmt: skip
    _check_device(hidden)
    n_tokens = labels.numel()
    cfg = config or default_config(n_tokens, weight.shape[0], weight.element_size())
    if cfg.chunk_tokens < 1 or cfg.block_v < 16 or cfg.block_v & (cfg.block_v - 1):
        raise ValueError(f"cross_entropy (triton): bad config {cfg}; need chunk_tokens >= 1, block_v a power of 2 >= 16")
    loss: torch.Tensor = _LinearCrossEntropy.apply(
        hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight, cfg, torch.is_grad_enabled()
    )
    return loss, (labels != ignore_index).sum()


def causal_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused token-level LM-head cross-entropy (labels already shifted); contract of ``eager``'s function.

    ``hidden [..., H]`` bf16/fp16/fp32, ``weight [V, H]`` same dtype, ``labels [...]`` int64. Returns
    ``(loss_sum, valid_count)``, 0-d fp32 and 0-d int64; gradients for hidden and (if it requires grad) weight.
    """
    return linear_cross_entropy(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap, z_loss_weight=z_loss_weight
    )


def sequence_classification_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused classifier-head cross-entropy: ``hidden [B, H]``, ``weight [C, H]``, ``labels [B]`` int64.

    Returns ``(loss_sum, valid_sequences)``, 0-d fp32 and 0-d int64.
    """
    return linear_cross_entropy(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant="seq_cls",
    )  # fmt: skip
