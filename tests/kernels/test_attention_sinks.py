"""Attention sinks, sliding windows and soft-cap: the eager oracle against transformers' gpt-oss definition, every
registered backend against the oracle (forward and backward, the sink gradient included) for the features it
declares, windows inside packed documents, Ulysses SP through the HF bridge on gloo ranks (sinks cut per rank,
windows on global positions), the capability registry and its build-time refusal, and clear errors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import pad_to_multiple, slice_for_rank
from veomni.kernels import KERNELS, OpsConfig, detect_hardware
from veomni.kernels.attention import ATTENTION_FUNCTIONS
from veomni.kernels.attention.features import ATTENTION_FEATURES, BACKEND_FEATURES, SINKS, SOFTCAP, WINDOW
from veomni.models.hf.attention import hf_attention_function

eager = ATTENTION_FUNCTIONS["eager"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed: int, seq: int = 13, heads_kv: int = 2, groups: int = 3, dim: int = 16, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads_kv * groups, dim, generator=gen)
    k = torch.randn(1, seq, heads_kv, dim, generator=gen)
    v = torch.randn(1, seq, heads_kv, dim, generator=gen)
    sinks = torch.randn(heads_kv * groups, generator=gen) * 2
    return [t.to(device).requires_grad_() for t in (q, k, v, sinks)]


def _features(names: tuple[str, ...], sinks: torch.Tensor) -> dict:
    values = {WINDOW: ("window", 4), SINKS: ("sinks", sinks), SOFTCAP: ("softcap", 2.5)}
    return dict(values[n] for n in names)


def _fwd_bwd(fn, leaves, grad_out, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    q, k, v, sinks = leaves
    if "sinks" in kwargs:
        kwargs["sinks"] = sinks
    out = fn(q, k, v, **kwargs)
    out.backward(grad_out)
    grads = [t.grad for t in leaves]
    return out.detach(), grads


def test_eager_is_gpt_oss_definition_forward_and_backward():
    # transformers' gpt-oss eager attention, with the mask its sliding-window layers build, is the definition.
    q, k, v, sinks = _inputs(0)
    seq = q.shape[1]
    pos = torch.arange(seq)
    allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 4)
    additive = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks = 3, sinks

    want, _ = gpt_oss_eager(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), additive, 0.25)
    got = eager(q, k, v, window=4, sinks=sinks, scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(got)
    want_grads = torch.autograd.grad(want, (q, k, v, sinks), grad)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_window_inside_packed_documents_equals_each_document_alone():
    q, k, v, sinks = _inputs(1, seq=17)
    cu = torch.tensor([0, 3, 11, 17], dtype=torch.int32)
    packed = eager(q, k, v, cu_seqlens=cu, window=3, sinks=sinks)
    bounds = cu.tolist()
    alone = torch.cat(
        [
            eager(q[:, a:b], k[:, a:b], v[:, a:b], window=3, sinks=sinks)
            for a, b in itertools.pairwise(bounds)
        ],
        1,
    )
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-6)
    # A window at least as long as the sequence is plain causal attention; sinks of -inf are no sinks.
    torch.testing.assert_close(eager(q, k, v, window=17), eager(q, k, v), rtol=0, atol=0)
    no_sink = torch.full_like(sinks, float("-inf"))
    torch.testing.assert_close(eager(q, k, v, sinks=no_sink), eager(q, k, v), rtol=1e-6, atol=1e-7)


# Registered backends that implement at least one optional feature; each is checked on every non-empty subset
# of its features, batched and packed. Backends this machine cannot run are skipped with the registry's reason.
FEATURE_SPECS = [
    s for s in KERNELS.specs() if s.op == "attention" and s.backend != "eager" and s.capabilities
]
HALF_ONLY = {"varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4"}


@pytest.mark.parametrize("spec", FEATURE_SPECS, ids=lambda s: s.backend)
def test_registered_backends_match_eager_on_their_features(spec):
    problem = spec.requires.unmet(detect_hardware())
    if problem:
        pytest.skip(f"{spec.backend}: {problem}")
    fn = spec.factory()
    dtype = torch.bfloat16 if spec.backend in HALF_ONLY else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    leaves = [t.to(dtype) for t in _inputs(2, device=DEVICE)]
    leaves32 = [t.detach().float() for t in leaves]
    grad_out = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    caps = sorted(spec.capabilities)
    subsets = [c for r in range(1, len(caps) + 1) for c in itertools.combinations(caps, r)]
    cu = torch.tensor([0, 5, 13], dtype=torch.int32, device=DEVICE)
    for names, packed in itertools.product(subsets, (False, True)):
        kwargs = _features(names, leaves[3])
        if packed:
            kwargs["cu_seqlens"] = cu
        want, want_grads = _fwd_bwd(eager, leaves32, grad_out, **kwargs)
        got, got_grads = _fwd_bwd(fn, leaves, grad_out.to(dtype), **kwargs)
        where = f"{spec.backend} {names} packed={packed}"
        torch.testing.assert_close(
            got.float(), want, rtol=tol, atol=tol, msg=lambda m, where=where: f"{where}: {m}"
        )
        for i, (g, w) in enumerate(zip(got_grads, want_grads, strict=True)):
            if i == 3 and "sinks" not in kwargs:
                assert g is None
                continue
            torch.testing.assert_close(
                g.float(), w, rtol=tol, atol=tol, msg=lambda m, i=i, where=where: f"{where} grad {i}: {m}"
            )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_on_cpu_matches_eager_with_every_feature():
    # flex is registered for CUDA (no CPU backward); its forward runs anywhere, the LSE rescaling included.
    q, k, v, sinks = (t.detach() for t in _inputs(4))
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    for cu_seqlens in (None, cu):
        kwargs = dict(window=3, sinks=sinks, softcap=2.0, cu_seqlens=cu_seqlens)
        torch.testing.assert_close(
            ATTENTION_FUNCTIONS["flex"](q, k, v, **kwargs), eager(q, k, v, **kwargs), rtol=1e-5, atol=1e-5
        )


def test_declared_capabilities_and_refusals():
    assert KERNELS.capabilities("attention", "eager") == frozenset(ATTENTION_FEATURES)
    assert KERNELS.capabilities("attention", "sdpa") == {SINKS, WINDOW}
    for backend, features in BACKEND_FEATURES.items():
        assert KERNELS.capabilities("attention", backend) == features
    q, k, v, sinks = (t.detach() for t in _inputs(5))
    with pytest.raises(NotImplementedError, match="'sdpa' does not implement softcap"):
        ATTENTION_FUNCTIONS["sdpa"](q, k, v, softcap=3.0)
    # Feature checks come before the hardware checks, so they are testable anywhere.
    with pytest.raises(NotImplementedError, match="'varlen' does not implement sinks"):
        ATTENTION_FUNCTIONS["varlen"](q, k, v, sinks=sinks)
    with pytest.raises(NotImplementedError, match="'flash_attn_2' does not implement sinks"):
        ATTENTION_FUNCTIONS["flash_attn_2"](q, k, v, sinks=sinks)
    with pytest.raises(ValueError, match="needs causal attention"):
        eager(q, k, v, causal=False, window=3)
    with pytest.raises(ValueError, match="int >= 1"):
        eager(q, k, v, window=0)
    with pytest.raises(ValueError, match=r"float \[Hq\] = \[6\]"):
        eager(q, k, v, sinks=sinks[:2])
    ops = OpsConfig(attention="sdpa")
    assert ops.capabilities("attention") == {SINKS, WINDOW}
    ops.require_capabilities("attention", {SINKS, WINDOW}, "gpt_oss")
    with pytest.raises(
        ValueError, match=r"needs \['softcap'\].*'sdpa', which lacks \['softcap'\].*with all of them: "
    ):
        ops.require_capabilities("attention", {SOFTCAP}, "gemma2")


# ---------------------------------------------------------------- Ulysses SP through the HF bridge


def _sp_case(ctx, backend: str, packed: bool) -> float:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), "cpu")
    q, k, v, sinks = _inputs(6, seq=11, heads_kv=2, groups=2, dim=8)
    module = torch.nn.Module()
    module.is_causal = True
    cu = torch.tensor([0, 4, 11], dtype=torch.int32) if packed else None
    seq = q.shape[1]
    want = eager(q, k, v, window=3, sinks=sinks, cu_seqlens=cu)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    ref = torch.autograd.grad(want, (q, k, v, sinks), grad)

    def shard(t):
        return slice_for_rank(pad_to_multiple(t.detach(), 1, ctx.world_size), 1, ctx.rank, ctx.world_size)

    local = [shard(t).transpose(1, 2).requires_grad_() for t in (q, k, v)]
    mine = sinks.detach().clone().requires_grad_()
    kwargs = {"sliding_window": 3, "s_aux": mine, "sp_unpadded_len": seq}
    if packed:
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    else:
        kwargs["position_ids"] = torch.arange(seq)[None]
        kwargs["position_ids"] = shard(kwargs["position_ids"][..., None])[..., 0]
    with use_parallel_state(state):
        out, _ = hf_attention_function(backend)(module, *local, None, scaling=None, **kwargs)
    worst = (out - shard(want)).abs().max().item()
    out.backward(shard(grad))
    for t, r in zip(local, ref[:3], strict=True):
        worst = max(worst, (t.grad.transpose(1, 2) - shard(r)).abs().max().item())
    # Each rank's sinks see only its heads and its queries: the full gradient is the sum over the SP group.
    dist.all_reduce(mine.grad, group=state.sp_group)
    return max(worst, (mine.grad - ref[3]).abs().max().item())


@pytest.mark.parametrize("backend, packed", [("sdpa", True), ("eager", False)])
def test_ulysses_sp2_sinks_and_window_match_single_process(dist_pools, backend, packed):
    for worst in dist_pools.get(2).run(_sp_case, backend, packed):
        assert worst < 1e-5


# ---------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["flex", "varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4"])
def test_gpu_backends_with_features_match_eager(name):
    from veomni.kernels.attention import available_attention_functions

    why = available_attention_functions()[name]
    if why != "ok":
        pytest.skip(why)
    leaves = [t.to(torch.bfloat16) for t in _inputs(8, seq=300, heads_kv=2, groups=4, dim=64, device="cuda")]
    grad_out = torch.randn(leaves[0].shape, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 120, 121, 300], dtype=torch.int32, device="cuda")
    for names in itertools.chain.from_iterable(
        itertools.combinations(sorted(BACKEND_FEATURES[name]), r) for r in (1, 2, 3)
    ):
        kwargs = (
            dict(_features(names, leaves[3]), cu_seqlens=cu, window=100)
            if WINDOW in names
            else _features(names, leaves[3])
        )
        want, want_grads = _fwd_bwd(eager, [t.detach().float() for t in leaves], grad_out.float(), **kwargs)
        got, got_grads = _fwd_bwd(ATTENTION_FUNCTIONS[name], leaves, grad_out, **kwargs)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        for g, w in zip(got_grads, want_grads, strict=True):
            if w is not None and g is not None:
                torch.testing.assert_close(g.float(), w, rtol=5e-2, atol=5e-2)
