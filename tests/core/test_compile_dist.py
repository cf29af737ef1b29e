"""Compiled blocks on real gloo process groups.

FSDP2: `compile_blocks` first, then `apply_fsdp2` (per-block ``fully_shard``, optionally activation
checkpointing), as `veomni.models.build.build_model` orders them. Every rank trains on the same packed row, so
the FSDP-averaged gradient must equal one eager process's gradient; ``aot_eager`` keeps the captured graphs op
for op, so the comparison is tight.

Ulysses SP: the sequence<->head all-to-alls inside attention are traced into the block's graph (no graph break
under ``fullgraph=True``); compiled and eager SP ranks agree bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import backend_params
from test_compile import BLOCKS, TRITON, loss_and_grads, packed, pair
from torch.distributed.tensor import DTensor

from veomni.core.compile import compile_blocks
from veomni.core.fsdp import FSDPPolicy, apply_fsdp2
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import slice_sequence


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _on(ctx, layers: int) -> tuple[torch.nn.Module, torch.nn.Module]:  # noqa: ANN001
    # Triton kernels where they run: on CUDA ranks, or through the interpreter (set when there is no GPU).
    triton_runs = ctx.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return pair(TRITON if triton_runs else {"rms_norm": "eager"}, layers=layers, device=str(ctx.device))


def _batch(ctx, lens: list[int], seed: int) -> dict[str, object]:  # noqa: ANN001
    return packed(lens, seed, device=str(ctx.device))


def _fsdp_step(ctx, ac: bool) -> None:
    torch._dynamo.reset()
    state = build_parallel_state(ParallelDims.for_world(ctx.world_size), ctx.device_type)
    eager, model = _on(ctx, layers=2)
    stats = compile_blocks(model, BLOCKS, backend="aot_eager").stats
    policy = FSDPPolicy(
        block_patterns=BLOCKS, param_dtype=None, reduce_dtype=torch.float32, activation_checkpointing=ac
    )
    apply_fsdp2(model, state, policy)
    for step, lens in enumerate(([5, 11], [3, 4, 9])):
        batch = _batch(ctx, lens, seed=step)
        want_loss, want_grads = loss_and_grads(eager, batch)
        with use_parallel_state(state):
            loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
        for (name, _), got, want in zip(model.named_parameters(), grads, want_grads, strict=True):
            torch.testing.assert_close(
                _full(got), want, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )
    assert stats.graphs == 1


@pytest.mark.slow
@pytest.mark.parametrize("world_size, backend", backend_params(2))
@pytest.mark.parametrize("ac", [False, True], ids=["no-ac", "ac"])
def test_compiled_blocks_under_fsdp2_match_eager(dist_pools, world_size, backend, ac):
    dist_pools.get(world_size, backend).run(_fsdp_step, ac)


def _sp_step(ctx) -> None:
    torch._dynamo.reset()
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    eager, model = _on(ctx, layers=1)
    stats = compile_blocks(model, BLOCKS, backend="aot_eager").stats
    for step, lens in enumerate(([5, 11], [3, 4, 9])):
        batch = _batch(ctx, lens, seed=step)
        packing = {k: v for k, v in batch.items() if k.startswith(("cu_seq_lens", "max_length"))}
        results = []
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            with use_parallel_state(state):
                logits = m(
                    input_ids=slice_sequence(batch["input_ids"], 1, group),
                    position_ids=slice_sequence(batch["position_ids"], 1, group),
                    sp_unpadded_len=sum(lens),
                    **packing,
                ).logits
            (logits.float().square().mean()).backward()
            results.append((logits.detach(), [p.grad.clone() for p in m.parameters()]))
        (want_logits, want_grads), (logits, grads) = results
        assert torch.equal(logits, want_logits)
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want)
    assert stats.graphs == 1


@pytest.mark.slow
@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_compiled_blocks_under_ulysses_sp_match_eager(dist_pools, world_size, backend):
    dist_pools.get(world_size, backend).run(_sp_step)
