"""Gated DeltaNet ops: eager oracles against the definition and transformers' torch functions; varlen equals
per-document runs; registry selection; fla parity (forward and backward) on CUDA.

The chunked delta rule is checked against the token-by-token recurrence (the definition) and against
transformers' Qwen3-Next torch functions (the model's reference semantics), in fp64 for exactness.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from veomni.kernels import KERNELS, Hardware, OpsConfig, detect_hardware, resolve_kernels
from veomni.kernels.linear_attention.eager import (
    causal_conv1d_eager,
    gated_delta_rule_eager,
    gated_delta_rule_recurrent,
    rms_norm_gated_eager,
)
from veomni.kernels.linear_attention.fla_support import fla_gated_delta_problem

CPU = Hardware(device_type="cpu")
H100 = Hardware(device_type="cuda", capability=(9, 0))
HAS_FLA = importlib.util.find_spec("fla") is not None


def delta_inputs(b, t, h, hv, dk, dv, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = F.logsigmoid(torch.randn(b, t, hv, generator=gen) + 2.0)  # decays in (0, 1), mostly close to 1
    beta = torch.rand(b, t, hv, generator=gen)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize(
    ("t", "h", "hv", "chunk"), [(1, 2, 2, 4), (13, 2, 4, 4), (16, 1, 2, 8), (21, 2, 2, 64)]
)
def test_chunked_equals_recurrence_and_transformers(t, h, hv, chunk):
    q, k, v, g, beta = delta_inputs(2, t, h, hv, 8, 6)
    ours = gated_delta_rule_eager(q, k, v, g, beta, chunk_size=chunk)
    definition = gated_delta_rule_recurrent(q, k, v, g, beta)
    torch.testing.assert_close(ours, definition, rtol=1e-9, atol=1e-9)
    # With fla installed transformers' wrapper dispatches to fla (CUDA-only); __wrapped__ is its torch fallback.
    theirs, _ = hf.torch_chunk_gated_delta_rule.__wrapped__(
        q, k, v, g, beta, chunk_size=chunk, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-5)
    # Backward through the chunked form matches backward through the recurrence.
    dy = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v, g, beta), dy)
    ref = torch.autograd.grad(definition, (q, k, v, g, beta), dy)
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


def test_varlen_delta_rule_resets_state_per_document():
    lengths = [5, 1, 11, 0, 7]
    q, k, v, g, beta = delta_inputs(1, sum(lengths), 2, 4, 8, 4, seed=3)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = gated_delta_rule_eager(q, k, v, g, beta, cu_seqlens=cu, chunk_size=4)
    alone = [
        gated_delta_rule_eager(*(x[:, a:b] for x in (q, k, v, g, beta)), chunk_size=4)
        for a, b in itertools.pairwise(cu.tolist())
        if b > a
    ]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-12)
    # Without cu_seqlens the state carries over: the packed row differs after the first document.
    leaky = gated_delta_rule_eager(q, k, v, g, beta, chunk_size=4)
    assert not torch.allclose(leaky[:, 5:], packed[:, 5:])


def test_causal_conv1d_matches_transformers_and_resets_per_document():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 6, generator=gen, dtype=torch.float64)
    w, bias = (
        torch.randn(6, 4, generator=gen, dtype=torch.float64),
        torch.randn(6, generator=gen, dtype=torch.float64),
    )
    fn = hf.causal_conv1d_fn.__wrapped__  # the torch fallback, whatever kernel package is installed
    theirs = fn(x.transpose(1, 2), w, bias, activation="silu").transpose(1, 2)
    torch.testing.assert_close(causal_conv1d_eager(x, w, bias, activation="silu"), theirs)
    torch.testing.assert_close(
        causal_conv1d_eager(x, w, None, activation=None), fn(x.transpose(1, 2), w, None).transpose(1, 2)
    )
    row = x.reshape(1, 18, 6)
    cu = torch.tensor([0, 2, 9, 18], dtype=torch.int32)
    packed = causal_conv1d_eager(row, w, bias, cu_seqlens=cu)
    alone = torch.cat(
        [causal_conv1d_eager(row[:, a:b], w, bias) for a, b in [(0, 2), (2, 9), (9, 18)]], dim=1
    )
    torch.testing.assert_close(packed, alone, rtol=0, atol=0)


def test_rms_norm_gated_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen).bfloat16()
    z = torch.randn(3, 5, 16, generator=gen).bfloat16()
    mod = hf.Qwen3NextRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        mod.weight.normal_(generator=gen)
    torch.testing.assert_close(rms_norm_gated_eager(x, z, mod.weight, 1e-6), mod(x, z), rtol=0, atol=0)


def test_bad_inputs_name_expected_and_found():
    q, k, v, g, beta = delta_inputs(2, 4, 2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"HV a multiple of H = 2, got \(2, 4, 3, 4\)"):
        gated_delta_rule_eager(q, k, v, g, beta)
    q, k, v, g, beta = delta_inputs(2, 4, 2, 2, 4, 4)
    with pytest.raises(ValueError, match=r"one packed row, B == 1; got B = 2"):
        gated_delta_rule_eager(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"rise from 0 to the row length 4 without decreasing, got \[0, 3\]"):
        causal_conv1d_eager(torch.randn(1, 4, 3), torch.randn(3, 2), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"weight must be \[C, W\] with C = 3"):
        causal_conv1d_eager(torch.randn(1, 4, 3), torch.randn(3, 1, 2))
    with pytest.raises(ValueError, match=r"activation must be one of \(None, 'silu'\), got 'gelu'"):
        causal_conv1d_eager(torch.randn(1, 4, 3), torch.randn(3, 2), activation="gelu")


def test_registry_defaults_and_fla_requirement():
    cpu = OpsConfig(hardware=CPU)
    assert (cpu.gated_delta_rule, cpu.causal_conv1d, cpu.rms_norm_gated) == ("eager", "eager", "eager")
    kernels = resolve_kernels(cpu)
    assert kernels.get("gated_delta_rule", "chunk") is gated_delta_rule_eager
    assert kernels.get("causal_conv1d", "standard") is causal_conv1d_eager
    assert kernels.get("rms_norm_gated", "standard") is rms_norm_gated_eager
    with pytest.raises(ValueError, match=r"gated_delta_rule='fla' cannot run here: .*needs cuda"):
        OpsConfig(gated_delta_rule="fla", hardware=CPU)
    gpu = OpsConfig(hardware=H100)
    expected = "fla" if HAS_FLA else "eager"  # without the [fla] extra the default falls back to the oracle
    assert (gpu.gated_delta_rule, gpu.causal_conv1d, gpu.rms_norm_gated) == (expected,) * 3
    assert KERNELS.backends("gated_delta_rule") == ["eager", "fla"]


def _installed(monkeypatch, triton: str, tilelang: bool) -> None:
    import triton as triton_module

    find_spec = importlib.util.find_spec
    # The imported module's version is what counts (a Triton first on PYTHONPATH can differ from the metadata).
    monkeypatch.setattr(triton_module, "__version__", triton)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: (
            (importlib.util.find_spec("os") if tilelang else None) if n == "tilelang" else find_spec(n, *a)
        ),
    )


def test_fla_gated_delta_rule_refused_where_fla_computes_wrong_gradients(monkeypatch):
    a100 = Hardware(device_type="cuda", capability=(8, 0))
    _installed(monkeypatch, "3.6.0", tilelang=False)
    problem = fla_gated_delta_problem(H100)
    assert "wrong gated-delta-rule gradients on Hopper with triton 3.6.0 (fla issue #640" in problem
    assert "upgrade triton to >= 3.7.1, install tilelang, or use gated_delta_rule: eager" in problem
    assert fla_gated_delta_problem(a100) is None and fla_gated_delta_problem(CPU) is None
    if HAS_FLA:
        with pytest.raises(ValueError, match=r"gated_delta_rule='fla' cannot run here: .*fla issue #640"):
            OpsConfig(gated_delta_rule="fla", hardware=H100)
        # The default falls back to the oracle (loudly); the other fla ops are unaffected.
        hopper = OpsConfig(hardware=H100)
        assert (hopper.gated_delta_rule, hopper.causal_conv1d) == ("eager", "fla")
        assert OpsConfig(hardware=a100).gated_delta_rule == "fla"
    for triton, tilelang in (("3.7.1", False), ("3.9.0+git0", False), ("3.3.1", False), ("3.6.0", True)):
        _installed(monkeypatch, triton, tilelang)
        assert fla_gated_delta_problem(H100) is None, (triton, tilelang)


def test_model_specific_fallbacks_are_reported_when_a_model_takes_the_kernel(monkeypatch, caplog):
    # Hopper with Triton 3.6 and no tilelang: fla's delta rule is refused (fla #640), or fla is absent altogether.
    # Either way the default falls back to the oracle; a model without Gated DeltaNet never hears of it, one with it
    # gets the warning once, when it takes the kernel.
    _installed(monkeypatch, "3.6.0", tilelang=False)
    with caplog.at_level(logging.WARNING, logger="veomni.kernels.config"):
        ops = OpsConfig(hardware=H100)
        assert ops.gated_delta_rule == "eager" and "gated_delta_rule" in ops.fallbacks
        assert not [r for r in caplog.records if "gated_delta_rule" in r.getMessage()]
        # A derived config (what the trainer binds: fp32 compute, compile off) keeps the record of the fallback.
        kernels = resolve_kernels(ops.for_compute_dtype(torch.float32).with_compile("off"))
        assert kernels.get("rms_norm", "standard") is not None  # other ops: nothing about the delta rule
        assert not [r for r in caplog.records if "gated_delta_rule" in r.getMessage()]
        for _ in range(3):
            assert kernels.get("gated_delta_rule", "chunk") is gated_delta_rule_eager
    reports = [r.getMessage() for r in caplog.records if "OpsConfig.gated_delta_rule" in r.getMessage()]
    assert len(reports) == 1 and "the cuda default 'fla' cannot run" in reports[0] and "using 'eager'" in reports[0]


def _fwd_bwd(fn, inputs, dy, **kw):
    out = fn(*inputs, **kw)
    return (out, *torch.autograd.grad(out, [x for x in inputs if x is not None and x.requires_grad], dy))


def _skip_unless_fla_runs(op: str) -> None:
    """GPU tests of fla's kernels: skipped, with the reason, where the registry would refuse fla for ``op``."""
    problem = KERNELS.backend_problem(op, "fla", detect_hardware())
    if problem is not None:
        pytest.skip(problem)


@pytest.mark.cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_fla_gated_delta_rule_matches_eager(varlen):
    _skip_unless_fla_runs("gated_delta_rule")
    from veomni.kernels.linear_attention.fla_impl import gated_delta_rule_fla

    b, t = (1, 300) if varlen else (2, 200)
    ins = delta_inputs(b, t, 2, 4, 64, 32, dtype=torch.float32, device="cuda")
    cu = torch.tensor([0, 17, 130, 131, 300], dtype=torch.int32, device="cuda") if varlen else None
    dy = torch.randn(b, t, 4, 32, device="cuda")
    ours = _fwd_bwd(gated_delta_rule_fla, ins, dy, cu_seqlens=cu)
    ref = _fwd_bwd(gated_delta_rule_eager, ins, dy, cu_seqlens=cu)
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=2e-3, atol=2e-3)


@pytest.mark.cuda
def test_fla_conv_and_gated_norm_match_eager():
    _skip_unless_fla_runs("causal_conv1d")
    _skip_unless_fla_runs("rms_norm_gated")
    from veomni.kernels.linear_attention.fla_impl import causal_conv1d_fla, rms_norm_gated_fla

    x = torch.randn(1, 300, 96, device="cuda", requires_grad=True)
    w = torch.randn(96, 4, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 3, 150, 300], dtype=torch.int32, device="cuda")
    dy = torch.randn(1, 300, 96, device="cuda")
    for a, r in zip(
        _fwd_bwd(causal_conv1d_fla, (x, w), dy, cu_seqlens=cu),
        _fwd_bwd(causal_conv1d_eager, (x, w), dy, cu_seqlens=cu),
        strict=False,
    ):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    xs = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    zs = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = (1 + 0.1 * torch.randn(128, device="cuda")).requires_grad_()
    dys = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    ours = _fwd_bwd(lambda a, b, c: rms_norm_gated_fla(a, b, c, 1e-6), (xs, zs, ws), dys)
    ref = _fwd_bwd(lambda a, b, c: rms_norm_gated_eager(a, b, c, 1e-6), (xs, zs, ws), dys)
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-2)
