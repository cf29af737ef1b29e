"""Loss and gradients of one step are identical for every (dp, sp, grad-accum) layout and one process.

A tiny causal LM with Ulysses attention trains one step on a global batch of variable-length sequences, some
with every label ignored. Each layout shards the batch over dp ranks and micro-steps and the sequence over sp
ranks; FSDP2 shards the parameters over dp x sp and averages gradients over the world. Both loss paths are exercised: per-rank means, and
SP-group means from `sp_token_mean`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import gpu_count
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from veomni.core.fsdp import FSDPPolicy, apply_fsdp2
from veomni.core.loss import (
    IGNORE_INDEX,
    count_valid_tokens,
    global_token_count,
    scale_loss_for_backward,
    sp_token_mean,
)
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.core.sp import slice_sequence, ulysses_attention

VOCAB, HIDDEN, HEADS, KV_HEADS = 13, 8, 4, 2


def causal_attention(q, k, v):
    """[B, S, H, D] causal attention with consecutive query heads sharing a KV head."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return out.transpose(1, 2)


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        d = HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HEADS * d)
        self.kv = nn.Linear(HIDDEN, 2 * KV_HEADS * d)
        self.o = nn.Linear(HEADS * d, HIDDEN)

    def forward(self, x: torch.Tensor, sp_group: dist.ProcessGroup, full_len: int) -> torch.Tensor:
        """x [B, S/P, hidden] (this rank's shard) -> [B, S/P, hidden]."""
        q = self.q(x).unflatten(-1, (HEADS, -1))
        k, v = self.kv(x).unflatten(-1, (2, KV_HEADS, -1)).unbind(2)
        attn = ulysses_attention(
            q, k, v, causal_attention, sp_group, seq_dim=1, head_dim=2, unpadded_len=full_len
        )
        return x + self.o(attn.flatten(-2))


class TinyCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([AttentionBlock() for _ in range(2)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, sp_group: dist.ProcessGroup, full_len: int) -> torch.Tensor:
        """ids [B, S/P] (this rank's shard) -> logits [B, S/P, V]."""
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, sp_group, full_len)
        return self.head(x)


def _build(device) -> TinyCausalLM:
    torch.manual_seed(1234)
    return TinyCausalLM().to(device)


def _sample(seed: int, length: int, all_ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length + 1), generator=gen)
    labels = ids[:, 1:].clone()  # shifted on the full sequence, before any slicing
    drop = torch.rand(labels.shape, generator=gen) < 0.3
    labels[drop | all_ignored] = IGNORE_INDEX
    return ids[:, :-1], labels


def _step(ctx, layout: tuple[int, int, int], samples: list[tuple[int, int, bool]], sp_path: bool):
    dp, sp, grad_accum = layout
    state = build_parallel_state(ParallelDims(dp_shard=dp, sp=sp), ctx.device_type)
    world = state.dims.loss_reduce
    data = [tuple(t.to(ctx.device) for t in _sample(*s)) for s in samples]

    # Oracle: one process, whole batch, mean over every valid token of the step.
    ref_model = _build(ctx.device)
    total_tokens = sum(int(count_valid_tokens(lab)) for _, lab in data)
    ref_sum = sum(
        F.cross_entropy(
            ref_model(ids, _single_group(ctx), ids.shape[1]).flatten(0, 1), lab.flatten(), reduction="sum"
        )
        for ids, lab in data
    )
    ref_loss = ref_sum / max(total_tokens, 1)
    ref_loss.backward()

    # Distributed: dp rank d takes samples d, d+dp, ...; sp ranks split each sequence.
    # FSDP2 shards over dp_shard x sp and averages gradients over the world.
    model = apply_fsdp2(_build(ctx.device), state, FSDPPolicy(block_patterns=("layers.*",), param_dtype=None))
    mine = [data[g * dp + state.dp_rank] for g in range(grad_accum)]
    shards = [
        (
            slice_sequence(ids, 1, state.sp_group),
            slice_sequence(lab, 1, state.sp_group, pad_value=IGNORE_INDEX),
        )
        for ids, lab in mine
    ]
    counts = [count_valid_tokens(lab) for _, lab in shards]
    n_global = global_token_count(counts, state.loss_group, state.device)
    step_sum = torch.zeros((), device=ctx.device)
    for (ids, _), (local_ids, local_lab), count in zip(mine, shards, counts, strict=True):
        logits = model(local_ids, state.sp_group, ids.shape[1])
        local_mean = F.cross_entropy(logits.flatten(0, 1), local_lab.flatten(), ignore_index=IGNORE_INDEX)
        if sp_path:
            mean, tokens = sp_token_mean(local_mean, count, state.sp_group)
            loss = scale_loss_for_backward(mean, tokens, n_global, world, replicas=sp)
        else:
            loss = scale_loss_for_backward(local_mean, count, n_global, world)
        assert torch.isfinite(loss), "an empty shard must give a zero loss, not NaN"
        loss.backward()
        step_sum += loss.detach()
    dist.all_reduce(step_sum, group=state.loss_group)
    step_loss = (
        step_sum / world
    )  # Σ over ranks and micro-steps of the scaled losses is W * the step's mean loss
    torch.testing.assert_close(step_loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert int(n_global) == total_tokens
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(
            p.grad.full_tensor(), ref_p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def _single_group(ctx) -> dist.ProcessGroup:
    # The oracle runs locally: with sp=1 the SP group holds only this rank, so attention does no communication.
    return build_parallel_state(ParallelDims(dp_shard=ctx.world_size), ctx.device_type).sp_group


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 4, 1), (2, 1, 2), (1, 2, 2)]


def _layout_params() -> list:
    params = []
    for layout in LAYOUTS:
        name = "dp{}-sp{}-ga{}".format(*layout)
        world = layout[0] * layout[1]
        params.append(pytest.param(layout, "gloo", id=f"gloo-{name}"))
        if world > 1:
            marks = [
                pytest.mark.multi_gpu,
                pytest.mark.skipif(gpu_count() < world, reason=f"needs {world} GPUs"),
            ]
            params.append(pytest.param(layout, "nccl", id=f"nccl-{name}", marks=marks))
    return params


@pytest.mark.parametrize("sp_path", [False, True], ids=["rank-mean", "sp-mean"])
@pytest.mark.parametrize("layout, backend", _layout_params())
@settings(max_examples=6)
@given(data=st.data())
def test_step_matches_single_process(dist_pools, layout, backend, data, sp_path):
    dp, sp, grad_accum = layout
    n = dp * grad_accum
    samples = [
        (data.draw(st.integers(0, 10**6)), data.draw(st.integers(1, 11)), data.draw(st.booleans()) and i == 0)
        for i in range(n)
    ]
    dist_pools.get(dp * sp, backend).run(_step, layout, samples, sp_path)


def _empty_sp_group(ctx):
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    local_mean = torch.tensor(float("nan"), device=ctx.device, requires_grad=True)
    mean, tokens = sp_token_mean(local_mean, 0, state.sp_group)
    loss = scale_loss_for_backward(mean, tokens, 0, ctx.world_size, replicas=ctx.world_size)
    loss.backward()
    return float(mean), int(tokens), float(loss), float(local_mean.grad)


def test_group_without_tokens_gives_zero_not_nan(dist_pools):
    for mean, tokens, loss, grad in dist_pools.get(2).run(_empty_sp_group):
        assert (mean, tokens, loss, grad) == (0.0, 0, 0.0, 0.0)


def test_scale_rejects_bad_sizes():
    with pytest.raises(ValueError, match="reduce_size and replicas must be >= 1"):
        scale_loss_for_backward(torch.tensor(1.0), 1, 1, 0)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        count_valid_tokens(torch.zeros(3))
