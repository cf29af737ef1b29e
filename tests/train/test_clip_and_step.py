"""`clip_and_step`: the clipping coefficient folded into fused AdamW's ``grad_scale`` (CUDA, one rank) updates the
parameters as clipping the gradients first does; elsewhere it is exactly clip + step."""

from __future__ import annotations

import pytest
import torch

from veomni.core.clip import clip_grad_norm
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.train.optim import _fused_on_cuda, build_adamw, clip_and_step


def _model(device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device, dtype)


def _two_ways(device: str, dtype: torch.dtype, max_norm: float):
    state = build_parallel_state(ParallelDims.for_world(1), device)
    results = []
    for folded in (True, False):
        model = _model(device, dtype)
        optimizer = build_adamw(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(16, 32, generator=gen).to(device, dtype)
            model(x).float().pow(2).sum().backward()
            if folded:
                norm, _ = clip_and_step(optimizer, model, max_norm, state)
            else:
                norm = clip_grad_norm(model, max_norm, state)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append((norm, [p.detach().clone() for p in model.parameters()], optimizer))
    return results


def _cpu_exact(ctx):
    (n1, p1, opt), (n2, p2, _) = _two_ways("cpu", torch.float32, 0.5)
    assert not _fused_on_cuda(opt)  # nothing folded off CUDA
    assert torch.equal(n1, n2) and all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))


def test_cpu_is_clip_then_step_exactly(dist_pools):
    dist_pools.get(1, "gloo").run(_cpu_exact)


def _cuda_close(ctx, dtype: torch.dtype):
    (n1, p1, opt), (n2, p2, _) = _two_ways("cuda", dtype, 0.5)
    assert _fused_on_cuda(opt) and float(n1) > 0.5  # clipping engaged, folded
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(n1, n2, **tol)
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_fold_updates_like_clipping_first(dist_pools, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dist_pools.get(1, "nccl").run(_cuda_close, dtype)
