"""Shared pieces of the loading / export tests: tiny configs, HF-saved checkpoints, gathering sharded models.

The oracle is always plain transformers: checkpoints are written by ``save_pretrained`` and read back by
``from_pretrained``; veomni's results are compared with what transformers produces from the same files.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Qwen3Config, Qwen3MoeConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM as HFQwen3
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM as HFQwen3Moe

from veomni.core.ep import expert_shards
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.kernels import OpsConfig

# Eager everywhere: the built model then computes exactly what upstream transformers computes.
EAGER = dict(
    attention="eager", rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager", cross_entropy="eager",
    load_balancing_loss="eager",
)  # fmt: skip


def eager_ops() -> OpsConfig:
    return OpsConfig(**EAGER)


def dense_config(tie: bool = True) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tie, pad_token_id=1,
    )  # fmt: skip


def moe_config(num_experts: int = 4) -> Qwen3MoeConfig:
    # E, H, I and 2I pairwise distinct (4/6, 32, 12, 24); layer 0 dense so mixed layers are covered.
    return Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_experts=num_experts,
        num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[0], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, norm_topk_prob=True,
        tie_word_embeddings=False,
    )  # fmt: skip


def save_hf(
    kind: str, path: str, seed: int = 0, max_shard_size: str | None = None, **kw: object
) -> nn.Module:
    """Build the upstream model with ``seed`` and write it with plain ``save_pretrained``; returns it."""
    config = dense_config(**kw) if kind == "dense" else moe_config(**kw)
    torch.manual_seed(seed)
    model = (HFQwen3 if kind == "dense" else HFQwen3Moe)(config).eval()
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    return model


def state(ctx, ep: int = 1, dp_replicate: int = 1):
    return build_parallel_state(
        ParallelDims.for_world(ctx.world_size, dp_replicate=dp_replicate, ep=ep), ctx.device_type
    )


def gather_state_dict(model: nn.Module, pstate) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict (on CPU) of a (FSDP / EP) model, assembled independently of veomni.models."""
    shards = expert_shards(model)
    out = {}
    for key, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        shard = shards.get(key)
        if shard is not None and shard.ep_size > 1:
            parts = [torch.empty_like(full) for _ in range(shard.ep_size)]
            dist.all_gather(parts, full.contiguous(), group=pstate.ep_group)
            full = torch.cat(parts, dim=0)
        out[key] = full.cpu()
    return out


def token_batch(seed: int = 3, rows: int = 2, seq: int = 10) -> torch.Tensor:
    return torch.randint(2, 96, (rows, seq), generator=torch.Generator().manual_seed(seed))


class Qwen3WithOpaqueBuffer(HFQwen3):
    """A model whose non-persistent buffer its own ``_init_weights`` does not know how to recompute."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.register_buffer("opaque", torch.arange(4.0), persistent=False)


def qwen2_vl_config():
    """A tiny Qwen2-VL: 2 text layers, 2 vision blocks; hidden sizes distinct from the vision tower's."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=2,
            temporal_patch_size=2, in_channels=3,
        ),
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def qwen3_5_moe_config(num_experts: int = 4):
    """A tiny Qwen3.5-MoE VLM: one linear-attention and one full-attention MoE layer, a 1-block vision tower."""
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=96, hidden_size=32, moe_intermediate_size=12, shared_expert_intermediate_size=16,
            num_experts=num_experts, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
            spatial_merge_size=2, temporal_patch_size=2,
        ),
    )  # fmt: skip


def save_composite(kind: str, path: str, seed: int = 0, max_shard_size: str | None = None) -> nn.Module:
    """Build the upstream composite (``"qwen2_vl"`` / ``"qwen3_5_moe"``) with ``seed``; ``save_pretrained`` it.

    transformers 5.23 writes both in their original Hub layout: Qwen2-VL as ``model.layers.*`` / ``visual.*``
    (reverting its recipe's renames), Qwen3.5-MoE with per-expert keys under ``model.language_model.``.
    """
    from transformers import Qwen2VLForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    cls, config = {
        "qwen2_vl": (Qwen2VLForConditionalGeneration, qwen2_vl_config),
        "qwen3_5_moe": (Qwen3_5MoeForConditionalGeneration, qwen3_5_moe_config),
    }[kind]
    torch.manual_seed(seed)
    model = cls(config()).eval()
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    return model


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded) safetensors checkpoint directory, read with safetensors itself."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out
