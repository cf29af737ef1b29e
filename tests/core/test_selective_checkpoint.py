"""Activation checkpointing that keeps the attention outputs (``keep_attention``): same gradients as no
checkpointing and as whole-block checkpointing, the attention forward not run again in backward, and refused on
compiled blocks (where it could select nothing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from veomni.core.checkpointing import apply_activation_checkpointing, is_attention_op
from veomni.core.compile import compile_blocks
from veomni.core.fsdp import FSDPPolicy


class Block(torch.nn.Module):
    def __init__(self, width: int = 16, heads: int = 2, attention: str = "sdpa") -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 32), torch.nn.GELU(), torch.nn.Linear(32, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.attention == "eager":  # the formula: nothing torch dispatches as one attention op
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            attn = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:  # a block without attention (a hybrid's linear-attention layer, say)
            attn = v
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(x)


class Tower(torch.nn.Module):
    def __init__(self, attention: tuple[str, str] = ("sdpa", "sdpa")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(attention=a) for a in attention])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class CountAttention(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += is_attention_op(func)
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


def test_keep_attention_that_keeps_nothing_is_an_error_at_the_first_forward_with_gradients():
    # Eager attention (as FlashAttention's own kernel launches) is invisible to the checkpoint policy: without the
    # check keep_attention would silently recompute every block whole.
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    model = Tower(("eager", "none"))
    apply_activation_checkpointing(model, ("blocks.*",), keep_attention=True)
    with torch.no_grad():
        model(x)  # an evaluation first: checkpointing saves nothing there, so it decides nothing
    keepable = r"ops.attention sdpa, varlen, flash_attn_2 or flash_attn_3"
    with pytest.raises(ValueError, match=rf"keep_attention.*ran no attention op.*{keepable}"):
        model(x)
    # One block with a saved kernel is enough: a hybrid's attention-free layers keep nothing by design.
    hybrid = Tower(("none", "sdpa"))
    apply_activation_checkpointing(hybrid, ("blocks.*",), keep_attention=True)
    hybrid(x).sum().backward()
    hybrid(x).sum().backward()  # checked once, then the hook is gone
    assert not hybrid._forward_hooks


class PackedBlock(torch.nn.Module):
    """A block attending through veomni's SDPA backend over a packed row: on the CPU that is the per-segment
    custom op (``veomni::sdpa_segments_fwd``), not an ATen SDPA op."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        from veomni.kernels.attention.functions import sdpa_attention

        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        attn = sdpa_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)
        return x + self.out(attn.reshape(b, s, w))


class RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep_attention", [False, True])
def test_keep_attention_saves_the_packed_cpu_attention_op(keep_attention: bool):
    # The default CPU attention of a packed row is veomni's per-segment op; keep_attention must save its output
    # like ATen's SDPA kernels' (before, the policy knew ATen's ops only and recomputed it: the setting did nothing).
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([PackedBlock(), PackedBlock()])})
    reference = [p.detach().clone() for p in model.parameters()]
    apply_activation_checkpointing(model, ("blocks.*",), keep_attention=keep_attention)
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    h = x
    for block in model["blocks"]:
        h = block(h, cu_seqlens=cu)
    with RecordOps() as record:
        h.square().mean().backward()
    recomputed = record.names.count("veomni::sdpa_segments_fwd")
    assert recomputed == (0 if keep_attention else 2)
    assert record.names.count("veomni::sdpa_segments_bwd") == 2
    # Same gradients as the uncheckpointed blocks.
    plain = torch.nn.ModuleList([PackedBlock(), PackedBlock()])
    with torch.no_grad():
        for p, value in zip(plain.parameters(), reference, strict=True):
            p.copy_(value)
    h = x
    for block in plain:
        h = block(h, cu_seqlens=cu)
    h.square().mean().backward()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_kv_cache_in_training_is_refused_with_the_fix_named():
    # transformers configs default to use_cache=True, and the model then hands every layer a cache that the layer
    # appends its keys to: the recomputation in backward would append them again (before: a CheckpointError about
    # tensor metadata, or a decoding error from the attention).
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    assert config.use_cache
    torch.manual_seed(0)
    plain = Qwen3ForCausalLM(config)
    checkpointed = Qwen3ForCausalLM(config)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, ("model.layers.*",))
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="use_cache=False"):
        checkpointed(input_ids=ids, labels=ids)
    with torch.no_grad():  # no recomputation without gradients: generation-style calls keep their cache
        assert checkpointed(input_ids=ids).past_key_values is not None
    plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    checkpointed(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
