"""Activation checkpointing that keeps the attention outputs (``keep_attention``): same gradients as no
checkpointing and as whole-block checkpointing, the attention forward not run again in backward, and refused on
compiled blocks (where it could select nothing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from veomni.core.compile import compile_blocks
from veomni.core.fsdp import ATTENTION_OPS, FSDPPolicy, apply_activation_checkpointing


class Block(torch.nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 32), torch.nn.GELU(), torch.nn.Linear(32, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
        x = x + self.out(attn)
        return x + self.mlp(x)


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class CountAttention(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def _grads_and_recomputed_attention(ac: str) -> tuple[list[torch.Tensor], int]:
    model = Tower()
    if ac != "off":
        apply_activation_checkpointing(model, ("blocks.*",), keep_attention=ac == "keep_attention")
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    with CountAttention() as counter:
        loss.backward()
    return [p.grad for p in model.parameters()], counter.calls


def test_keep_attention_saves_the_attention_forward_and_keeps_the_gradients():
    plain, none_recomputed = _grads_and_recomputed_attention("off")
    whole, recomputed = _grads_and_recomputed_attention("whole")
    kept, kept_recomputed = _grads_and_recomputed_attention("keep_attention")
    assert none_recomputed == 0 and recomputed == 2  # whole-block checkpointing reruns each block's attention
    assert kept_recomputed == 0
    for a, b, c in zip(plain, whole, kept, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_keep_attention_refuses_compiled_blocks_and_is_a_policy_field():
    model = Tower()
    compile_blocks(model, ("blocks.*",), backend="eager")
    with pytest.raises(ValueError, match="compiled.*ops.compile: off"):
        apply_activation_checkpointing(model, ("blocks.*",), keep_attention=True)
    policy = FSDPPolicy(block_patterns=("blocks.*",), activation_checkpointing=True, ac_keep_attention=True)
    assert policy.ac_keep_attention
    with pytest.raises(ValueError, match="activation_checkpointing is False"):
        FSDPPolicy(block_patterns=("blocks.*",), ac_keep_attention=True)
