"""Linear log-probs + entropy: the eager oracle against the textbook formulas, the chunked and Triton backends
against the oracle, forward and gradients through both outputs at once.

Without CUDA the Triton row kernels run through Triton's interpreter (tests/conftest.py; marker ``triton_cpu``,
small shapes) and the GEMMs on the CPU. GPU twins at real shapes carry ``cuda``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from veomni.kernels import KERNELS, Hardware, OpsConfig, resolve_kernels
from veomni.kernels.log_probs import chunked, eager, triton_impl
from veomni.kernels.log_probs.triton_impl import LaunchConfig

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Relative Frobenius error of the gradients (see `_rel`). fp32 against the fp64 oracle: reduction-order noise.
# Half precision against eager on the same inputs: both round the logits and the logit gradient to the input
# dtype, at different points (the interpreter also rounds fp32 -> bf16 toward zero, not to nearest).
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2 if _INTERPRETED else 1e-2, torch.float16: 3e-3}
# Per-token log-probs and entropies: both sides take fp32 statistics of the logits rounded to the input dtype. On
# the GPU cuBLAS may round a logit the other way in a chunk than in the whole GEMM (bf16: one ulp, 2^-5 for |z| in
# [4, 8)), which the absolute part covers, divided by the temperature.
VALUE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
VALUE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.04, torch.float16: 0.005}


def _inputs(n, hidden, vocab, dtype, *, ignore_every=3, seed=0, frozen_weight=False, device="cpu"):  # noqa: ANN001, ANN202
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(device, dtype).requires_grad_()
    # Scaled so logits are O(1..5), as in a trained LM head.
    w = (torch.randn(vocab, hidden, generator=gen) * (2.0 / math.sqrt(hidden))).to(device, dtype)
    w.requires_grad_(not frozen_weight)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if ignore_every:
        targets[::ignore_every] = eager.IGNORE_INDEX
    # Upstream gradients per token, as a DPO or policy-gradient loss sends them (some negative, some zero).
    g_logp = torch.randn(n, generator=gen).to(device)
    g_ent = torch.randn(n, generator=gen).to(device)
    return h, w, targets.to(device), g_logp, g_ent


def _fwd_bwd(fn, h, w, targets, g_logp, g_ent, *, use=("logp", "ent"), **kw):  # noqa: ANN001, ANN202
    """Run ``fn``; backward ``sum(g_logp * logps) + sum(g_ent * entropy)`` (the terms named in ``use``)."""
    h = h.detach().clone().requires_grad_(h.requires_grad)
    w = w.detach().clone().requires_grad_(w.requires_grad)
    logps, ent = fn(h, w, targets, **kw)
    terms = []
    if "logp" in use:
        terms.append((logps * g_logp.to(logps.dtype)).sum())
    if "ent" in use and ent is not None:
        terms.append((ent * g_ent.to(ent.dtype)).sum())
    if terms and logps.requires_grad:
        sum(terms).backward()
    return logps.detach(), None if ent is None else ent.detach(), h.grad, w.grad


def _oracle(h, w, targets, g_logp, g_ent, **kw):  # noqa: ANN001, ANN202
    """The eager reference; for fp32 inputs run in fp64 (results cast back), so fp32 backends are held to fp32
    rounding rather than to eager's own fp32 noise."""
    if h.dtype != torch.float32:
        return _fwd_bwd(eager.linear_log_probs, h, w, targets, g_logp, g_ent, **kw)
    use = kw.pop("use", ("logp", "ent"))
    args = (kw.pop("ignore_index", eager.IGNORE_INDEX), kw.pop("logit_softcap", None), kw.pop("temperature", 1.0),
            kw.pop("entropy", False))  # fmt: skip
    assert not kw, kw
    logps, ent, dh, dw = _fwd_bwd(
        lambda a, b, c: eager.log_probs_unchecked(a, b, c, *args),
        h.double(), w.double(), targets, g_logp.double(), g_ent.double(), use=use,
    )  # fmt: skip
    cast = lambda t: None if t is None else t.float()  # noqa: E731
    return cast(logps), cast(ent), cast(dh), cast(dw)


def _rel(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """Frobenius error over ``tol·‖b‖ + atol·√n`` (pass: <= 1). The absolute part, 10% of ``tol`` per element,
    covers gradients that are exactly zero (V = 1: every log-prob and entropy is 0 whatever the weights)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / (tol * b.norm() + 0.1 * tol * b.numel() ** 0.5 + 1e-30)).item()


def _assert_parity(got, want, dtype, *, temperature=1.0, grad_tol=None) -> None:  # noqa: ANN001
    grad_tol = grad_tol or GRAD_TOL[dtype]
    atol = VALUE_ATOL[dtype] / min(1.0, temperature)
    for name, a, b in (("logps", got[0], want[0]), ("entropy", got[1], want[1])):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
            assert bool(torch.isfinite(a).all()), name
            torch.testing.assert_close(
                a, b, rtol=VALUE_RTOL[dtype], atol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )
    for name, a, b in (("d_hidden", got[2], want[2]), ("d_weight", got[3], want[3])):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
            assert _rel(a, b, grad_tol) <= 1.0, (name, _rel(a, b, grad_tol), grad_tol)


# ------------------------------------------------------------------------------------------------- eager oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "temperature"), [(None, 1.0), (2.5, 0.6), (30.0, 1.7)])
def test_eager_equals_log_softmax_gather_and_entropy_formula(dtype, softcap, temperature) -> None:  # noqa: ANN001
    h, w, targets, _, _ = _inputs(11, 24, 53, dtype)
    logps, ent = eager.linear_log_probs(
        h, w, targets, logit_softcap=softcap, temperature=temperature, entropy=True
    )
    logits = (h @ w.t()).float()  # the GEMM in the input dtype, then fp32, as HF's LM head
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    valid = targets != -100
    want = logp_all.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1) * valid
    probs = torch.softmax(logits, dim=-1)
    want_ent = -(probs * logp_all).sum(-1) * valid
    assert logps.dtype == ent.dtype == torch.float32 and logps.shape == ent.shape == (11,)
    torch.testing.assert_close(logps, want)
    torch.testing.assert_close(ent, want_ent)
    assert bool((logps[~valid] == 0).all()) and bool((ent[~valid] == 0).all())
    # Without entropy: None, and the same log-probs.
    only, none = eager.linear_log_probs(h, w, targets, logit_softcap=softcap, temperature=temperature)
    assert none is None and torch.equal(only, logps)


def test_eager_entropy_is_maximal_for_uniform_and_zero_for_one_hot() -> None:
    h = torch.zeros(2, 4)
    w = torch.randn(7, 4)
    logps, ent = eager.linear_log_probs(h, w, torch.tensor([3, -100]), entropy=True)
    torch.testing.assert_close(logps, torch.tensor([-math.log(7), 0.0]))
    torch.testing.assert_close(ent, torch.tensor([math.log(7), 0.0]))
    peaked = torch.zeros(1, 7)
    peaked[0, 2] = 1.0
    logps, ent = eager.linear_log_probs(torch.ones(1, 1), peaked.t() * 200, torch.tensor([2]), entropy=True)
    assert abs(float(logps)) < 1e-6 and abs(float(ent)) < 1e-6


# ------------------------------------------------------------------------------------- chunked and triton parity


@st.composite
def _cases(draw):  # noqa: ANN001, ANN202
    n = draw(st.integers(0, 30))
    hidden = draw(st.integers(1, 40))
    # Vocabularies that are no multiple of any block, and ones smaller than a block.
    vocab = draw(st.one_of(st.sampled_from([1, 2, 17, 129, 257]), st.integers(1, 300)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    softcap = draw(st.sampled_from([None, 2.5, 30.0]))
    temperature = draw(st.sampled_from([1.0, 0.6, 1.7]))
    ignore_every = draw(st.sampled_from([0, 1, 2, 3]))  # 1 = every target ignored
    frozen = draw(st.booleans())
    use = draw(st.sampled_from([("logp", "ent"), ("logp",), ("ent",)]))
    entropy = draw(st.booleans()) or "ent" in use
    chunk = draw(st.integers(1, 32))
    block = draw(st.sampled_from([16, 32, 128]))
    return n, hidden, vocab, dtype, softcap, temperature, ignore_every, frozen, use, entropy, chunk, block


def _check_case(case, backend: str) -> None:  # noqa: ANN001
    n, hidden, vocab, dtype, softcap, temperature, ignore_every, frozen, use, entropy, chunk, block = case
    h, w, targets, g_logp, g_ent = _inputs(
        n, hidden, vocab, dtype, ignore_every=ignore_every, frozen_weight=frozen
    )
    kw = {"logit_softcap": softcap, "temperature": temperature, "entropy": entropy, "use": use}
    want = _oracle(h, w, targets, g_logp, g_ent, **kw)
    if backend == "triton":
        got = _fwd_bwd(triton_impl.linear_log_probs, h, w, targets, g_logp, g_ent, config=LaunchConfig(chunk, block, 1), **kw)  # fmt: skip
    else:
        got = _fwd_bwd(chunked.linear_log_probs, h, w, targets, g_logp, g_ent, chunk_tokens=chunk, **kw)
    _assert_parity(got, want, dtype, temperature=temperature)


@settings(max_examples=40)
@given(case=_cases())
def test_chunked_matches_eager(case) -> None:  # noqa: ANN001
    _check_case(case, "chunked")


@pytest.mark.triton_cpu
@settings(max_examples=30)
@given(case=_cases())
def test_triton_matches_eager(case) -> None:  # noqa: ANN001
    _check_case(case, "triton")


TRITON_CPU = pytest.param("triton", marks=pytest.mark.triton_cpu)
BACKENDS = ["chunked", TRITON_CPU]


def _fn(backend: str):  # noqa: ANN202
    return {"eager": eager, "chunked": chunked, "triton": triton_impl}[backend].linear_log_probs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_config_with_gradient_through_both_outputs(backend: str, dtype: torch.dtype) -> None:
    # V = 1100 puts 544 fp32 rows inside the triton backend's half-precision dW buffer, so its in-place
    # conversion runs the small head block and two doubling blocks.
    h, w, targets, g_logp, g_ent = _inputs(13, 8, 1100, dtype)
    kw = {"logit_softcap": 20.0, "temperature": 0.8, "entropy": True}
    want = _oracle(h, w, targets, g_logp, g_ent, **kw)
    got = _fwd_bwd(_fn(backend), h, w, targets, g_logp, g_ent, **kw)
    _assert_parity(got, want, dtype, temperature=0.8)


@pytest.mark.parametrize("backend", ["eager", *BACKENDS])
def test_leading_dims_all_ignored_and_empty(backend: str) -> None:
    fn = _fn(backend)
    h, w, targets, _, _ = _inputs(6, 16, 37, torch.bfloat16)
    logps, ent = fn(h.view(2, 3, 16), w, targets.view(2, 3), entropy=True)
    assert logps.shape == ent.shape == (2, 3)
    flat, flat_ent = fn(h, w, targets, entropy=True)
    assert torch.equal(logps.view(-1), flat) and torch.equal(ent.view(-1), flat_ent)
    h, w, targets, g_logp, g_ent = _inputs(5, 16, 37, torch.bfloat16, ignore_every=1)
    logps, ent, dh, dw = _fwd_bwd(fn, h, w, targets, g_logp, g_ent, entropy=True)
    assert bool((logps == 0).all()) and bool((ent == 0).all())
    assert bool((dh == 0).all()) and bool((dw == 0).all())
    h, w, targets, g_logp, g_ent = _inputs(0, 16, 37, torch.float32)
    logps, ent, dh, dw = _fwd_bwd(fn, h, w, targets, g_logp, g_ent, entropy=True)
    assert logps.shape == ent.shape == (0,) and dh.shape == (0, 16) and bool((dw == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_hidden_and_no_grad_mode(backend: str) -> None:
    h, w, targets, g_logp, g_ent = _inputs(9, 16, 40, torch.float32)
    h.requires_grad_(False)
    want = _oracle(h, w, targets, g_logp, g_ent, entropy=True)
    got = _fwd_bwd(_fn(backend), h, w, targets, g_logp, g_ent, entropy=True)
    assert got[2] is None
    _assert_parity(got, want, torch.float32)
    with torch.no_grad():
        logps, ent = _fn(backend)(h, w, targets, entropy=True)
    assert not logps.requires_grad and not ent.requires_grad
    torch.testing.assert_close(logps, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_and_linear_in_the_upstream_gradients(backend: str) -> None:
    h, w, targets, g_logp, g_ent = _inputs(21, 16, 70, torch.bfloat16)
    kw = {"entropy": True, "logit_softcap": 4.0}
    if backend == "triton":
        kw["config"] = LaunchConfig(5, 32, 1)
    a = _fwd_bwd(_fn(backend), h, w, targets, g_logp, g_ent, **kw)
    b = _fwd_bwd(_fn(backend), h, w, targets, g_logp, g_ent, **kw)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    # The logit gradient is linear in the upstream gradients: scaling both by 4 (exact in binary) scales the
    # fp32 logit gradient by 4 exactly, and so every rounded gradient.
    c = _fwd_bwd(_fn(backend), h, w, targets, 4 * g_logp, 4 * g_ent, **kw)
    assert torch.equal(c[2], 4 * a[2]) and torch.equal(c[3], 4 * a[3])


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any floating-point tensor an op produces (Triton's interpreter
    moves kernel arguments through byte-typed storages, which are not logits and are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_full_logits_tensor_is_materialised(backend: str) -> None:
    tokens, hidden, vocab, chunk = 64, 8, 300, 16
    h, w, targets, g_logp, g_ent = _inputs(tokens, hidden, vocab, torch.float32)
    kw = {"config": LaunchConfig(chunk, 128, 1)} if backend == "triton" else {"chunk_tokens": chunk}
    with _LargestTensor() as probe:
        _fwd_bwd(_fn(backend), h, w, targets, g_logp, g_ent, entropy=True, logit_softcap=5.0, **kw)
    assert probe.largest == chunk * vocab < tokens * vocab
    with _LargestTensor() as eager_probe:
        _fwd_bwd(eager.linear_log_probs, h, w, targets, g_logp, g_ent, entropy=True)
    assert eager_probe.largest >= tokens * vocab  # the probe does see a full logits tensor when one exists


@pytest.mark.triton_cpu
def test_triton_out_of_range_target_gives_nan_and_no_double_backward() -> None:
    h, w, targets, _, _ = _inputs(4, 8, 10, torch.float32, ignore_every=0)
    targets[1] = 10  # no host check (it would sync): that token's log-prob is poisoned instead
    logps, _ = triton_impl.linear_log_probs(h, w, targets)
    assert bool(torch.isnan(logps[1])) and bool(torch.isfinite(logps[[0, 2, 3]]).all())
    targets[1] = 3
    logps, _ = triton_impl.linear_log_probs(h, w, targets)
    (grad_h,) = torch.autograd.grad(logps.sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="(?i)once_differentiable|does not require grad"):
        torch.autograd.grad(grad_h.sum(), h)


@pytest.mark.parametrize("backend", ["eager", *BACKENDS])
def test_bad_inputs_raise_clear_errors(backend: str) -> None:
    fn = _fn(backend)
    h, w, targets, _, _ = _inputs(6, 8, 11, torch.float32)
    name = f"log_probs \\({backend}\\)"
    with pytest.raises(
        TypeError, match=rf"{name}: weight dtype torch.bfloat16 must equal hidden dtype torch.float32"
    ):
        fn(h, w.bfloat16(), targets)
    with pytest.raises(TypeError, match=r"targets must be int64 token ids, got torch.int32"):
        fn(h, w, targets.int())
    with pytest.raises(TypeError, match=r"hidden must be bf16, fp16 or fp32, got torch.float64"):
        fn(h.double(), w.double(), targets)
    with pytest.raises(ValueError, match=r"targets shape \(5,\) must equal hidden's leading shape \(6,\)"):
        fn(h, w, targets[:5])
    # A transposed head ([H, V]) or one from another model: H does not match.
    with pytest.raises(ValueError, match=r"must end in weight's H = 11, got shape \(6, 8\)"):
        fn(h, w.t().contiguous(), targets)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\], got shape \(88,\)"):
        fn(h, w.reshape(-1), targets)
    with pytest.raises(ValueError, match=r"weight must have at least one vocabulary row, got shape \(0, 8\)"):
        fn(h, w[:0], targets)
    with pytest.raises(ValueError, match=r"logit_softcap must be None or a finite float > 0, got 0.0"):
        fn(h, w, targets, logit_softcap=0.0)
    with pytest.raises(ValueError, match=r"temperature must be a finite float > 0, got 0.0"):
        fn(h, w, targets, temperature=0.0)
    with pytest.raises(ValueError, match=r"temperature must be a finite float > 0, got inf"):
        fn(h, w, targets, temperature=math.inf)
    with pytest.raises(TypeError, match=r"entropy must be a bool, got 1"):
        fn(h, w, targets, entropy=1)
    with pytest.raises(TypeError, match=r"ignore_index must be an int, got 1.5"):
        fn(h, w, targets, ignore_index=1.5)


def test_backend_specific_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    h, w, targets, _, _ = _inputs(3, 8, 11, torch.float32)
    with pytest.raises(ValueError, match=r"chunk_tokens must be an int >= 1, got 0"):
        chunked.linear_log_probs(h, w, targets, chunk_tokens=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors .*TRITON_INTERPRET=1"):
        triton_impl.linear_log_probs(h, w, targets)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="bad config"):
        triton_impl.linear_log_probs(h, w, targets, config=LaunchConfig(4, 24, 1))


def test_registered_backends_and_ops_config_selection() -> None:
    assert KERNELS.backends("log_probs") == ["chunked", "eager", "triton"]
    assert KERNELS.variants("log_probs") == ["linear"]
    cpu = Hardware(device_type="cpu")
    assert OpsConfig(hardware=cpu).log_probs == "eager"
    assert OpsConfig(hardware=Hardware(device_type="cuda", capability=(9, 0))).log_probs == "triton"
    kernels = resolve_kernels(OpsConfig(log_probs="chunked", hardware=cpu))
    assert kernels.get("log_probs", "linear") is chunked.linear_log_probs
    with pytest.raises(
        ValueError, match=r"log_probs='triton' cannot run here.*Runnable here: \['chunked', 'eager'\]"
    ):
        OpsConfig(log_probs="triton", hardware=cpu)


# ---------------------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "n"), [(torch.bfloat16, 4096), (torch.float32, 1024)], ids=["bf16-4096", "fp32-1024"]
)
@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_cuda_parity_at_qwen_vocab(backend: str, dtype: torch.dtype, n: int) -> None:
    # Qwen3's V = 151,936, H = 2048, a quarter of the targets ignored, soft-cap and temperature on, gradient through
    # both outputs; triton once with 768-row chunks (the last partial), once with the default chunking.
    h, w, targets, g_logp, g_ent = _inputs(n, 2048, 151_936, dtype, ignore_every=4, device="cuda")
    kw = {"logit_softcap": 30.0, "temperature": 0.9, "entropy": True}
    want = _oracle(h, w, targets, g_logp, g_ent, **kw)
    torch.cuda.empty_cache()
    # fp32: cuBLAS sums K = 151,936 products for dX, a few 1e-6 from the fp64 oracle.
    tol = 3e-5 if dtype == torch.float32 else None
    if backend == "triton":
        got = _fwd_bwd(triton_impl.linear_log_probs, h, w, targets, g_logp, g_ent, config=LaunchConfig(768, 8192, 16), **kw)  # fmt: skip
        _assert_parity(got, want, dtype, temperature=0.9, grad_tol=tol)
    got = _fwd_bwd(_fn(backend), h, w, targets, g_logp, g_ent, **kw)
    _assert_parity(got, want, dtype, temperature=0.9, grad_tol=tol)


@pytest.mark.cuda
def test_cuda_deterministic_and_no_host_sync() -> None:
    h, w, targets, g_logp, g_ent = _inputs(4096, 2048, 32_768, torch.bfloat16, device="cuda")
    a = _fwd_bwd(triton_impl.linear_log_probs, h, w, targets, g_logp, g_ent, entropy=True)
    b = _fwd_bwd(triton_impl.linear_log_probs, h, w, targets, g_logp, g_ent, entropy=True)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _fwd_bwd(triton_impl.linear_log_probs, h, w, targets, g_logp, g_ent, entropy=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got[2], a[2])


@pytest.mark.cuda
@pytest.mark.parametrize("entropy", [False, True])
def test_cuda_peak_memory_at_t3_shape(entropy: bool) -> None:
    # T3: 16,384 tokens, H = 2048, V = 151,936, bf16. The stated bound: dW (V·H·2, kept as .grad) + the fp32
    # accumulator of dW's upper half (≈ V·H·2) + one [chunk, V] logits buffer + dX (T·H·2, kept as .grad) + the
    # outputs, saved row stats and upstream gradients (6 fp32 per token), plus 32 MiB for cuBLAS and small buffers.
    n, hidden, vocab = 16_384, 2048, 151_936
    h, w, targets, g_logp, g_ent = _inputs(n, hidden, vocab, torch.bfloat16, ignore_every=0, device="cuda")
    cfg = triton_impl.default_config(n, vocab, 2)
    n0 = (vocab // 2) // 8 * 8
    bound = vocab * hidden * 2 + (vocab - n0) * hidden * 4 + cfg.chunk_tokens * vocab * 2 + n * hidden * 2
    bound += 6 * n * 4 + 32 * 2**20
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logps, ent = triton_impl.linear_log_probs(h, w, targets, entropy=entropy)
    loss = (logps * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0.0)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= bound, (peak / 2**30, bound / 2**30)
    assert bool(torch.isfinite(logps).all()) and h.grad is not None and w.grad.dtype == torch.bfloat16
