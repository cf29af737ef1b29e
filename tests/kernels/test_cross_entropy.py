"""Linear cross-entropy: the triton (and, on GPU, liger) backends against the eager oracle, forward and backward.

Without CUDA the Triton row kernel runs through Triton's interpreter (tests/conftest.py) and the GEMMs on the
CPU, so CPU shapes stay small. GPU tests at real shapes carry ``cuda``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.cross_entropy import eager, triton_impl
from veomni.kernels.cross_entropy.triton_impl import LaunchConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Relative Frobenius error of the gradients. fp32: reduction-order noise. Half precision: both sides round the
# logits and the logit gradient to the input dtype, but at different points (eager scales by grad_output before
# rounding, the fused kernel after; the interpreter also rounds fp32 -> bf16 toward zero, not to nearest).
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2 if _INTERPRETED else 1e-2, torch.float16: 3e-3}
# Loss sums: both sides take the fp32 log-sum-exp of the logits rounded to the input dtype. On the GPU cuBLAS may
# round a logit the other way in a chunk than in the whole GEMM, which moves that token's loss by up to one ulp of
# the logit (bf16: 2^-5 for |z| in [4, 8)); the absolute part covers one such token.
LOSS_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-4, torch.float16: 2e-4}
LOSS_ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.04, torch.float16: 0.005}


def _inputs(lead, hidden, vocab, dtype, *, ignore_every=3, seed=0, frozen_weight=False, device=DEVICE):  # noqa: ANN001, ANN202
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=gen).to(device, dtype).requires_grad_()
    # Scaled so logits are O(1..5), as in a trained LM head.
    w = (torch.randn(vocab, hidden, generator=gen) * (2.0 / math.sqrt(hidden))).to(device, dtype)
    w.requires_grad_(not frozen_weight)
    labels = torch.randint(0, vocab, tuple(lead), generator=gen)
    if ignore_every:
        labels.view(-1)[::ignore_every] = eager.IGNORE_INDEX
    return h, w, labels.to(device)


def _fwd_bwd(fn, h, w, labels, grad_scale=0.37, **kw):  # noqa: ANN001, ANN202
    h = h.detach().clone().requires_grad_(h.requires_grad)
    w = w.detach().clone().requires_grad_(w.requires_grad)
    loss, count = fn(h, w, labels, **kw)
    if loss.requires_grad:
        loss.backward(torch.tensor(grad_scale, device=loss.device, dtype=loss.dtype))
    return loss.detach(), count, h.grad, w.grad


def _oracle(h, w, labels, grad_scale=0.37, **kw):  # noqa: ANN001, ANN202
    """The eager reference; for fp32 inputs run in fp64 (eager's own fp32 gradient loses ~1e-4 to cancellation
    in ``(1 + 2 z lse) * p - 1`` when p is near 1), results cast back to the input dtype."""
    if h.dtype != torch.float32:
        return _fwd_bwd(eager.causal_lm_cross_entropy, h, w, labels, grad_scale, **kw)
    kw.setdefault("ignore_index", eager.IGNORE_INDEX)
    kw.setdefault("logit_softcap", None)
    kw.setdefault("z_loss_weight", 0.0)
    loss, count, dh, dw = _fwd_bwd(
        eager.linear_ce_unchecked, h.double(), w.double(), labels, grad_scale, **kw
    )
    h_grad = None if dh is None else dh.view(h.shape).float()
    return loss.float(), count, h_grad, None if dw is None else dw.float()


def _rel(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """Frobenius error over ``tol·‖b‖ + atol·√n`` (pass: <= 1). The absolute part, 10% of ``tol`` per element,
    covers gradients that are exactly zero (V = 1 without z-loss: softmax - onehot = 0), where what is left is
    the rounding of softmax probabilities of size ~1 (exp2 and FMA contraction on the GPU)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / (tol * b.norm() + 0.1 * tol * b.numel() ** 0.5 + 1e-30)).item()


def _assert_parity(got, want, dtype, grad_tol=None) -> None:  # noqa: ANN001
    grad_tol = grad_tol or GRAD_TOL[dtype]
    loss, count, dh, dw = got
    e_loss, e_count, e_dh, e_dw = want
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == int(e_count)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, e_loss, rtol=LOSS_TOL[dtype], atol=LOSS_ATOL[dtype])
    for name, a, b in (("d_hidden", dh, e_dh), ("d_weight", dw, e_dw)):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
            assert _rel(a, b, grad_tol) <= 1.0, (name, _rel(a, b, grad_tol), grad_tol)


@st.composite
def _cases(draw):  # noqa: ANN001, ANN202
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    if math.prod(lead) > 40:
        lead = [min(d, 3) for d in lead]
    hidden = draw(st.integers(1, 48))
    # Vocabularies that are no multiple of any block, and ones smaller than a block.
    vocab = draw(st.one_of(st.sampled_from([1, 2, 17, 129, 257]), st.integers(1, 300)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    softcap = draw(st.sampled_from([None, 2.5, 30.0]))
    z_loss = draw(st.sampled_from([0.0, 1e-3, 0.1]))
    ignore_every = draw(st.sampled_from([0, 1, 2, 3]))  # 1 = every label ignored
    frozen = draw(st.booleans())
    chunk = draw(st.integers(1, 48))
    block = draw(st.sampled_from([16, 32, 128]))
    programs_per_sm = draw(st.sampled_from([0, 1, 2]))  # 0: a program per row; else programs walk rows
    cfg = LaunchConfig(chunk, block, 1, programs_per_sm)
    return lead, hidden, vocab, dtype, softcap, z_loss, ignore_every, frozen, cfg


@settings(max_examples=40)
@given(case=_cases())
def test_triton_matches_eager(case) -> None:  # noqa: ANN001
    lead, hidden, vocab, dtype, softcap, z_loss, ignore_every, frozen, cfg = case
    h, w, labels = _inputs(lead, hidden, vocab, dtype, ignore_every=ignore_every, frozen_weight=frozen)
    kw = {"logit_softcap": softcap, "z_loss_weight": z_loss}
    want = _oracle(h, w, labels, **kw)
    got = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=cfg, **kw)
    _assert_parity(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_config_bsh_input_and_split_weight_grad(dtype: torch.dtype) -> None:
    # [B, S, H] input; V = 1100 puts 544 fp32 rows inside the half-precision dW buffer, so the in-place
    # conversion runs its small head block and two doubling blocks ([256, 512), [512, 544)).
    h, w, labels = _inputs((2, 3), 8, 1100, dtype)
    want = _oracle(h, w, labels)
    got = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)
    assert got[2].shape == (2, 3, 8)
    _assert_parity(got, want, dtype)


def test_all_ignored_gives_zero_and_zero_grads() -> None:
    h, w, labels = _inputs((4, 5), 16, 37, torch.bfloat16, ignore_every=1)
    loss, count, dh, dw = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)
    assert float(loss) == 0.0 and int(count) == 0
    assert bool((dh == 0).all()) and bool((dw == 0).all())


def test_empty_input() -> None:
    h, w, labels = _inputs((0,), 16, 37, torch.float32)
    loss, count, dh, dw = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)
    assert float(loss) == 0.0 and int(count) == 0 and dh.shape == (0, 16) and bool((dw == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seq_cls(dtype: torch.dtype) -> None:
    h, w, labels = _inputs((6,), 24, 5, dtype, ignore_every=4)
    want = _fwd_bwd(eager.sequence_classification_cross_entropy, h, w, labels, z_loss_weight=0.01)
    got = _fwd_bwd(triton_impl.sequence_classification_cross_entropy, h, w, labels, z_loss_weight=0.01)
    _assert_parity(got, want, dtype)
    with pytest.raises(ValueError, match=r"hidden must be \[B, H\].*got shape \(2, 3, 24\)"):
        triton_impl.sequence_classification_cross_entropy(h.view(2, 3, 24), w, labels.view(2, 3))


def test_frozen_hidden_gives_weight_grad_only_and_no_grad_mode_gives_loss() -> None:
    h, w, labels = _inputs((9,), 16, 40, torch.float32)
    h.requires_grad_(False)
    want = _oracle(h, w, labels)
    got = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)
    assert got[2] is None
    _assert_parity(got, want, torch.float32)
    with torch.no_grad():
        loss, _ = triton_impl.causal_lm_cross_entropy(h, w, labels)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-5)


def test_deterministic_and_grad_scaled_once() -> None:
    h, w, labels = _inputs((3, 7), 16, 70, torch.bfloat16)
    cfg = LaunchConfig(5, 32, 1)
    a = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=cfg)
    b = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=cfg)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    # Gradients are linear in grad_output: scaling it by 4 (exact in binary) scales every gradient by 4 exactly.
    c = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=cfg, grad_scale=4 * 0.37)
    assert torch.equal(c[2], 4 * a[2]) and torch.equal(c[3], 4 * a[3])


def test_out_of_range_label_makes_loss_nan_and_second_backward_raises() -> None:
    h, w, labels = _inputs((4,), 8, 10, torch.float32, ignore_every=0)
    labels[1] = 10  # no host check (it would sync): the loss is poisoned instead
    loss, count = triton_impl.causal_lm_cross_entropy(h, w, labels)
    assert torch.isnan(loss) and int(count) == 4
    labels[1] = 3
    loss, _ = triton_impl.causal_lm_cross_entropy(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="hands them out once"):
        loss.backward()


@pytest.mark.parametrize("fn", [eager.causal_lm_cross_entropy, triton_impl.causal_lm_cross_entropy])
def test_bad_inputs_raise_clear_errors(fn) -> None:  # noqa: ANN001
    h, w, labels = _inputs((2, 3), 8, 11, torch.float32)
    with pytest.raises(TypeError, match=r"weight dtype torch.bfloat16 must equal hidden dtype torch.float32"):
        fn(h, w.bfloat16(), labels)
    with pytest.raises(TypeError, match=r"labels must be int64 class ids, got torch.int32"):
        fn(h, w, labels.int())
    with pytest.raises(TypeError, match=r"hidden must be bf16, fp16 or fp32, got torch.float64"):
        fn(h.double(), w.double(), labels)
    with pytest.raises(ValueError, match=r"labels shape \(3, 2\) must equal hidden's leading shape \(2, 3\)"):
        fn(h, w, labels.view(3, 2))
    with pytest.raises(ValueError, match=r"must end in weight's H = 9, got shape \(2, 3, 8\)"):
        fn(h, torch.randn(11, 9, device=DEVICE), labels)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\], got shape \(88,\)"):
        fn(h, w.reshape(-1), labels)
    with pytest.raises(ValueError, match=r"logit_softcap must be None or a finite float > 0, got 0.0"):
        fn(h, w, labels, logit_softcap=0.0)
    with pytest.raises(ValueError, match=r"z_loss_weight must be a finite float >= 0, got -1.0"):
        fn(h, w, labels, z_loss_weight=-1.0)
    with pytest.raises(TypeError, match=r"ignore_index must be an int, got 1.5"):
        fn(h, w, labels, ignore_index=1.5)


def test_triton_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    h, w, labels = _inputs((3,), 8, 11, torch.float32, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors .*TRITON_INTERPRET=1"):
        triton_impl.causal_lm_cross_entropy(h, w, labels)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="bad config"):
        triton_impl.linear_cross_entropy(h, w, labels, config=LaunchConfig(4, 24, 1))


# ---------------------------------------------------------------------------------------------- GPU, real shapes


def _peak_extra(fn, *args, **kw) -> tuple[int, tuple]:  # noqa: ANN001
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, count = fn(*args, **kw)
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, (loss, count)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_parity_at_qwen_vocab(dtype: torch.dtype) -> None:
    # Qwen3's V = 151,936, H = 2048, 2048 tokens with a quarter of the labels ignored, soft-cap and z-loss on;
    # once with 768-row chunks (three, the last partial), once with the default chunking.
    h, w, labels = _inputs((2, 1024), 2048, 151_936, dtype, ignore_every=4, device="cuda")
    kw = {"logit_softcap": 30.0, "z_loss_weight": 1e-4}
    want = _oracle(h, w, labels, **kw)
    torch.cuda.empty_cache()
    got = _fwd_bwd(
        triton_impl.linear_cross_entropy, h, w, labels, config=LaunchConfig(768, 8192, 16, 1), **kw
    )
    # fp32: cuBLAS sums K = 151,936 products for dX, a few 1e-6 from the fp64 oracle.
    tol = 3e-5 if dtype == torch.float32 else None
    _assert_parity(got, want, dtype, tol)
    got_default = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels, **kw)
    _assert_parity(got_default, want, dtype, tol)


@pytest.mark.cuda
def test_cuda_uninitialised_memory_never_leaks_in() -> None:
    # Fill the allocator's cache with NaN so the kernel's torch.empty buffers start poisoned.
    junk = torch.full((512 * 2**20,), float("nan"), device="cuda")
    del junk
    h, w, labels = _inputs((1500,), 512, 50_000, torch.bfloat16, device="cuda")
    got = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=LaunchConfig(512, 4096, 16))
    want = _oracle(h, w, labels)
    assert all(bool(torch.isfinite(t).all()) for t in got[2:])
    _assert_parity(got, want, torch.bfloat16)


@pytest.mark.cuda
def test_cuda_fallback_dw_accumulation_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Torch releases whose addmm cannot accumulate half products into an fp32 self take the block-wise path.
    monkeypatch.setattr(triton_impl, "_FALLBACK_ROWS", 3000)  # several blocks per half of V
    h, w, labels = _inputs((1000,), 256, 20_000, torch.bfloat16, device="cuda")
    fused = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=LaunchConfig(384, 8192, 16))
    monkeypatch.setattr(triton_impl, "mixed_addmm_supported", lambda device: False)
    fallback = _fwd_bwd(triton_impl.linear_cross_entropy, h, w, labels, config=LaunchConfig(384, 8192, 16))
    assert torch.equal(fused[0], fallback[0]) and torch.equal(fused[2], fallback[2])
    # The same fp32 sums in a different order of additions: dW agrees to fp32 rounding before the bf16 rounding.
    assert _rel(fallback[3], fused[3], 1e-3) <= 1.0


@pytest.mark.cuda
def test_cuda_deterministic() -> None:
    h, w, labels = _inputs((4096,), 2048, 32_768, torch.bfloat16, device="cuda")
    a = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)
    b = _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.cuda
def test_cuda_peak_memory_at_t3_shape() -> None:
    # T3: 16,384 tokens, H = 2048, V = 151,936, bf16. The stated bound: dW (V·H·2, kept as .grad) + the fp32
    # accumulator of dW's upper half (≈ V·H·2) + one [chunk, V] logits buffer + dX (T·H·2, kept as .grad) +
    # per-token fp32 losses, plus 32 MiB for cuBLAS workspace and small buffers. Eager needs ≈ 37 GiB.
    n, hidden, vocab = 16_384, 2048, 151_936
    h, w, labels = _inputs((n,), hidden, vocab, torch.bfloat16, ignore_every=0, device="cuda")
    cfg = triton_impl.default_config(n, vocab, 2)
    n0 = (vocab // 2) // 8 * 8
    bound = vocab * hidden * 2 + (vocab - n0) * hidden * 4 + cfg.chunk_tokens * vocab * 2 + n * hidden * 2
    bound += n * 4 + 32 * 2**20
    peak, (loss, count) = _peak_extra(triton_impl.causal_lm_cross_entropy, h, w, labels)
    assert peak <= bound, (peak / 2**30, bound / 2**30)
    assert torch.isfinite(loss) and int(count) == n
    assert h.grad is not None and w.grad is not None and w.grad.dtype == torch.bfloat16


@pytest.mark.cuda
def test_cuda_no_host_sync() -> None:
    h, w, labels = _inputs((3, 700), 256, 5000, torch.bfloat16, device="cuda")
    _fwd_bwd(triton_impl.causal_lm_cross_entropy, h, w, labels)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, count = triton_impl.causal_lm_cross_entropy(h, w, labels)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and h.grad is not None and w.grad is not None
