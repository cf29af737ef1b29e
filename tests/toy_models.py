"""Small models for the FSDP/EP/clipping tests: a dense transformer-ish stack and an MoE variant.

Both map token ids ``[B, S]`` int64 to logits ``[B, S, V]``. Shapes are tiny and deliberately uneven (V, S)
so FSDP's dim-0 sharding pads. The MoE experts module holds fused ``w1 [E, H, I]`` and ``w2 [E, I, H]``; with
an EP group it dispatches tokens with `dispatch_tokens`/`combine_tokens`, without one it loops over experts
(an independent implementation, used as the single-process oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from veomni.core.ep import ExpertPlan, combine_tokens, dispatch_tokens
from veomni.core.fsdp import forward_through

MOE_PLAN = ExpertPlan(patterns=("layers.*.experts.w1", "layers.*.experts.w2"))


class DenseBlock(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)
        # Non-persistent: no checkpoint restores it; a meta-built model must recompute it in its init_fn.
        self.register_buffer("gate", torch.empty(hidden), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.gate.copy_(torch.linspace(0.5, 1.5, self.gate.numel()))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * self.gate.to(x.dtype)


class Experts(nn.Module):
    """Fused SiLU-MLP experts; ``ep_group`` set by the test when EP is on."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, inter) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, inter, hidden) / inter**0.5)
        self.ep_group = None

    def _expert(self, x: Tensor, e: int) -> Tensor:
        return F.silu(x @ self.w1[e]) @ self.w2[e]

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """``x [T, H]``, ``expert_ids [T, k]`` int64, ``weights [T, k]`` -> ``[T, H]``."""
        if self.ep_group is not None:
            tokens, counts, handle = dispatch_tokens(x, expert_ids, self.num_experts, self.ep_group)
            outs = [self._expert(chunk, e) for e, chunk in enumerate(tokens.split(counts))]
            return combine_tokens(torch.cat(outs), weights, handle)
        if self.w1.shape[0] != self.num_experts:
            raise RuntimeError("EP-sliced experts need ep_group to be set")
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            token_idx, slot = (expert_ids == e).nonzero(as_tuple=True)
            y = self._expert(x[token_idx], e).float() * weights[token_idx, slot].float().unsqueeze(-1)
            out = out.index_add(0, token_idx, y)
        return out.to(x.dtype)


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.mix = nn.Linear(hidden, hidden)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter)

    def forward(self, x: Tensor) -> Tensor:
        x = x + torch.tanh(self.mix(x))
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(flat, ids, weights).view_as(x)


def _head_logits(head: nn.Linear, h: Tensor) -> Tensor:
    return F.linear(h, head.weight)


class ToyModel(nn.Module):
    """Embedding -> blocks -> norm -> head. ``moe=True`` uses `MoEBlock` layers. ``read_head_weight=True`` reads
    the head's weight instead of calling it, as a fused linear-cross-entropy does (through `forward_through`)."""

    def __init__(
        self,
        vocab: int = 11,
        hidden: int = 8,
        inter: int = 12,
        layers: int = 2,
        *,
        moe: bool = False,
        num_experts: int = 4,
        top_k: int = 2,
        read_head_weight: bool = False,
    ) -> None:
        super().__init__()
        self.read_head_weight = read_head_weight
        self.embed = nn.Embedding(vocab, hidden)
        if moe:
            self.layers = nn.ModuleList(MoEBlock(hidden, inter, num_experts, top_k) for _ in range(layers))
        else:
            self.layers = nn.ModuleList(DenseBlock(hidden, inter) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("logit_scale", torch.ones(()))  # persistent: travels with the state dict

    def forward(self, input_ids: Tensor) -> Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        logits = forward_through(self.head, _head_logits, h) if self.read_head_weight else self.head(h)
        return logits * self.logit_scale

    def set_ep_group(self, group) -> None:
        for layer in self.layers:
            layer.experts.ep_group = group


def build(seed: int, device: torch.device | str = "cpu", **kwargs) -> ToyModel:
    """The same fp32 weights on every rank for the same ``seed``."""
    torch.manual_seed(seed)
    return ToyModel(**kwargs).to(device)


def init_fn(module: nn.Module) -> None:
    """Deterministic init used after meta-device materialisation (rewrites what each module owns)."""
    if isinstance(module, DenseBlock):
        module.reset_buffers()
    if isinstance(module, ToyModel):
        module.logit_scale.fill_(1.0)
    for p in module.parameters(recurse=False):
        p.fill_(0.0)


def token_batch(seed: int, batch: int, seq: int, vocab: int = 11) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)``, both ``[batch, seq]`` int64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
