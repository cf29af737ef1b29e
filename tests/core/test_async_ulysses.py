"""Async Ulysses (projection overlapped with the all-to-all) equals one process in output, input gradient and
every projection weight's gradient (values and shapes; the reference's async path had wrong-shape weight
gradients), on real gloo groups; and equals the synchronous `ulysses_attention` (outputs bit for bit)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import backend_params
from test_ulysses_attention import eager_attention

from veomni.core.sp import async_ulysses_attention, slice_sequence, ulysses_attention


def _layer(seed: int, hidden: int, hq: int, hkv: int, d: int, dv: int) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({
        "q": torch.nn.Linear(hidden, hq * d, dtype=torch.float64),
        "k": torch.nn.Linear(hidden, hkv * d, bias=False, dtype=torch.float64),
        "v": torch.nn.Linear(hidden, hkv * dv, dtype=torch.float64),
    })  # fmt: skip


def _projector(layer, hq, hkv, d, dv, order: str = "vqk"):
    """A ``project`` generator: [B, S, hidden] -> (name, [B, S, H, D]) in ``order``; a per-head scale on q stands
    in for the norms/RoPE a real layer applies."""
    make = {
        "q": lambda x: layer["q"](x).unflatten(-1, (hq, d)) * 0.5,
        "k": lambda x: layer["k"](x).unflatten(-1, (hkv, d)),
        "v": lambda x: layer["v"](x).unflatten(-1, (hkv, dv)),
    }

    def project(x):
        for name in order:
            yield name, make[name](x)

    return project, make


def _parity(ctx, case: dict):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    b, s, hidden, hq, hkv, d, dv = (case[k] for k in ("b", "s", "hidden", "hq", "hkv", "d", "dv"))
    layer = _layer(case["seed"], hidden, hq, hkv, d, dv).to(ctx.device)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    # Drawn on the CPU (the same values on every rank and backend), then moved to the group's device.
    x = torch.randn(b, s, hidden, generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()
    probe = torch.randn(b, s, hq, dv, generator=gen, dtype=torch.float64).to(ctx.device)
    project, make = _projector(layer, hq, hkv, d, dv, case.get("order", "vqk"))

    ref = eager_attention(*(make[n](x) for n in "qkv"))  # one process, full sequence
    (ref * probe).sum().backward()
    ref_x = x.grad.clone()
    ref_w = {n: p.grad.clone() for n, p in layer.named_parameters()}

    results = {}
    for name in ("async", "sync"):
        layer.zero_grad(set_to_none=True)
        local = slice_sequence(x.detach(), 1, group).requires_grad_()
        if name == "async":
            out = async_ulysses_attention(
                local, project, eager_attention, group, seq_dim=1, head_dim=2, query_heads=hq, unpadded_len=s
            )
        else:
            out = ulysses_attention(
                *(make[n](local) for n in "qkv"),
                eager_attention,
                group,
                seq_dim=1,
                head_dim=2,
                unpadded_len=s,
            )
        (out * slice_sequence(probe, 1, group)).sum().backward()
        results[name] = (
            out.detach(),
            local.grad.clone(),
            {n: p.grad.clone() for n, p in layer.named_parameters()},
        )

    out, dx, dw = results["async"]
    torch.testing.assert_close(out, slice_sequence(ref.detach(), 1, group), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dx, slice_sequence(ref_x, 1, group), rtol=1e-9, atol=1e-10)
    for n, g in dw.items():
        assert g.shape == ref_w[n].shape, (n, g.shape, ref_w[n].shape)
        total = g.clone()
        torch.distributed.all_reduce(total, group=group)  # each rank holds its tokens' share
        torch.testing.assert_close(total, ref_w[n], rtol=1e-9, atol=1e-10, msg=n)
    # Against the synchronous path: the same values (the input gradient sums its q/k/v parts in another order).
    sync_out, sync_dx, sync_dw = results["sync"]
    assert torch.equal(out, sync_out)
    torch.testing.assert_close(dx, sync_dx, rtol=1e-12, atol=1e-13)
    for n in dw:
        torch.testing.assert_close(dw[n], sync_dw[n], rtol=1e-12, atol=1e-13, msg=n)


CASES = [
    {"b": 2, "s": 8, "hidden": 12, "hq": 4, "hkv": 4, "d": 3, "dv": 3, "seed": 0},  # MHA
    {"b": 1, "s": 11, "hidden": 8, "hq": 8, "hkv": 2, "d": 4, "dv": 2, "seed": 1},  # GQA, S % P != 0, Dv != D
    {"b": 1, "s": 9, "hidden": 8, "hq": 4, "hkv": 1, "d": 2, "dv": 2, "seed": 2, "order": "qkv"},  # 1 KV head
]


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
@pytest.mark.parametrize("case", CASES, ids=["mha", "gqa-ragged", "one-kv-head"])
def test_async_ulysses_matches_one_process_and_the_sync_path(dist_pools, world_size, backend, case):
    if case["hq"] % world_size:
        pytest.skip("query heads not divisible")
    dist_pools.get(world_size, backend).run(_parity, case)


def _bad(ctx):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    x = torch.randn(1, 4, 6, device=ctx.device)

    def twice(t):
        yield "q", t.unflatten(-1, (2, 3))
        yield "q", t.unflatten(-1, (2, 3))

    with pytest.raises(ValueError, match="yield 'q', 'k' and 'v' once each; got 'q'"):
        async_ulysses_attention(x, twice, eager_attention, group, seq_dim=1, head_dim=2, query_heads=2)

    def three_heads(t):
        for name in "qkv":
            yield name, t.unflatten(-1, (3, 2))

    with pytest.raises(ValueError, match="query heads divisible by the SP size"):
        async_ulysses_attention(x, three_heads, eager_attention, group, seq_dim=1, head_dim=2, query_heads=3)


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_async_ulysses_refuses_bad_input(dist_pools, world_size, backend):
    dist_pools.get(world_size, backend).run(_bad)
