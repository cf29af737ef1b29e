"""One row per registered transformers model type with a ``causal_lm`` class: the tiny config the adapter
conformance suite (`test_conformance`) builds it from, and what the suite must know to compare it with upstream.

Adding a family's model type to the suite is one `Row` in `ROWS`. A registered model type without a row fails the
suite, naming it. Every config keeps the published model's ratios (GQA, explicit head_dim, expert width, layer
layout) cut to small widths and few layers, so a CPU check takes a second or two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import (
    DeepseekV3Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SeedOssConfig,
)

CHECKS = ("parity", "parity_sdpa", "packed", "sp", "async_sp", "export")
"""The suite's checks: bitwise parity with upstream (eager attention; ``parity_sdpa``: both on transformers' sdpa),
packed == per-document, SP == one process (``async_sp``: with the async Ulysses exchange, where the family declares
it), export round trip."""

VOCAB = 128


@dataclass(frozen=True)
class Row:
    """How the conformance suite builds and compares one model type.

    Attributes:
        config: a fresh tiny config (the model type's own config class; composite VLM configs too, whose
            ``causal_lm`` class is built from the text config as transformers' Auto class does).
        sp_overrides: config changes for the 2-rank SP check (head counts divisible by the SP size).
        perturb: ``perturb(model)`` redraws what upstream initialises to constants (offset norms, biases, sinks,
            router correction biases) so the paths that read them count; applied to upstream before its weights
            are copied into ours.
        torch_fallback: functions of upstream's modeling module that dispatch to CUDA-only flash-linear-attention
            when it is installed; the suite runs their ``__wrapped__`` torch originals (what upstream computes
            without fla) because its upstream models run on CPU tensors.
        skip: ``{check: reason}`` for a check (`CHECKS`) the model type cannot run; the suite skips that cell
            with the reason.
    """

    config: Callable[[], PretrainedConfig]
    sp_overrides: Mapping[str, object] = field(default_factory=dict)
    perturb: Callable[[torch.nn.Module], None] | None = None
    torch_fallback: tuple[str, ...] = ()
    skip: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.skip) - set(CHECKS))
        if unknown:
            raise ValueError(f"skip names checks {unknown}; the checks are {list(CHECKS)}")


def redraw(*suffixes: str, std: float = 0.1) -> Callable[[torch.nn.Module], None]:
    """A `Row.perturb` drawing every parameter or buffer whose name ends with one of ``suffixes`` from
    N(0, ``std``) (seeded, so upstream and every rank draw the same values)."""

    def apply(model: torch.nn.Module) -> None:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(suffixes) and tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)

    return apply


# Dense decoder ratios (GQA 2:1, intermediate 3x hidden, explicit head_dim), cut in width and depth.
DENSE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip

# Qwen3-Next / Qwen3.5 hybrid layout: 3 Gated DeltaNet layers then 1 full-attention layer, grouped value heads
# (4 v heads on 2 k heads).
HYBRID = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0], "mrope_interleaved": True}  # fmt: skip
HYBRID_MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.05)  # fmt: skip
# Under SP the Gated DeltaNet heads are split over the ranks: 4 key / 8 value heads (grouped 2:1), 4 KV heads.
HYBRID_SP = dict(linear_num_key_heads=4, linear_num_value_heads=8, num_key_value_heads=4)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
GDN_FALLBACK = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")  # fmt: skip
OFFSET_NORMS = redraw("norm.weight")  # zero-initialised (1 + w) norms would hide the offset


def _qwen3_5_text(moe: bool) -> dict:
    return dict(HYBRID, rope_parameters=dict(QWEN3_5_ROPE), **(HYBRID_MOE if moe else {}))


# Every bias on and head_dim 24 != hidden / heads, so a kernel assuming either shows; no dropout.
SEED_OSS = dict(DENSE, head_dim=24, attention_bias=True, attention_out_bias=True, mlp_bias=True,
                attention_dropout=0.0, residual_dropout=0.0)  # fmt: skip
# Qwen3-30B-A3B's ratios; layer 0 dense (mlp_only_layers) so both MLP kinds run.
QWEN3_MOE = dict(
    DENSE, intermediate_size=160, num_hidden_layers=3, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
    mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.05, norm_topk_prob=True,
)  # fmt: skip
# DeepSeek-V3's structure: MLA with q LoRA and every head size different (nope 12, rope 8, v 10), group-limited
# routing (8 experts in 2 groups, 1 kept, top-3) with a non-zero correction bias, 2 shared experts, layer 0 dense.
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
    qk_rope_head_dim=8, v_head_dim=10, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
    max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
# gpt-oss: odd sizes, sinks, a window of 4 (the sliding layer differs from the full one on these lengths), yarn RoPE
# scaled down, a low swiglu_limit so the clamps bite.
GPT_OSS = dict(
    vocab_size=VOCAB, hidden_size=36, intermediate_size=20, num_local_experts=4, num_experts_per_tok=2,
    num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
    tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.05, swiglu_limit=1.5,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip
# Qwen3-Next-80B-A3B's structure: partial RoPE, layer 0 dense, the rest routed + shared experts.
QWEN3_NEXT = dict(
    HYBRID, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    mlp_only_layers=[0], partial_rotary_factor=0.25, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    output_router_logits=True, router_aux_loss_coef=0.05, norm_topk_prob=True,
)  # fmt: skip
# GLM-4.5's structure: head_dim 24 with partial RoPE (half rotates), GQA 4:2, q/k norm and attention biases, 8 experts
# in 2 groups (1 kept, top-3) with a correction bias, 2 shared experts, layer 0 dense.
GLM4_MOE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, partial_rotary_factor=0.5, use_qk_norm=True,
    attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
GDN_SP_OVERRIDES = {f"text_config.{k}": v for k, v in HYBRID_SP.items()}

# Gemma 3: a sliding layer (window 5, shorter than the test rows) then a global one, each with its own RoPE base, a
# softmax scale from query_pre_attn_scalar, a final logit soft-cap small enough to bite, and tied embeddings as the
# released checkpoints have (no lm_head.weight on disk; under SP the LM head is the embedding's weight).
GEMMA3 = dict(
    DENSE, tie_word_embeddings=True, sliding_window=5, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
    final_logit_softcapping=0.5, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
)  # fmt: skip

ROWS: dict[str, Row] = {
    "llama": Row(lambda: LlamaConfig(**DENSE)),
    "qwen2": Row(lambda: Qwen2Config(**DENSE)),
    "qwen3": Row(lambda: Qwen3Config(**DENSE)),
    "seed_oss": Row(lambda: SeedOssConfig(**SEED_OSS)),
    "gemma3_text": Row(lambda: Gemma3TextConfig(**GEMMA3), perturb=OFFSET_NORMS),
    "qwen3_moe": Row(lambda: Qwen3MoeConfig(**QWEN3_MOE)),
    "deepseek_v3": Row(lambda: DeepseekV3Config(**DEEPSEEK_V3), perturb=redraw("e_score_correction_bias")),
    "glm4_moe": Row(
        lambda: Glm4MoeConfig(**GLM4_MOE), perturb=redraw("e_score_correction_bias", "proj.bias")
    ),
    "gpt_oss": Row(
        lambda: GptOssConfig(**GPT_OSS),
        perturb=redraw("bias", "sinks", std=0.5),  # upstream zero-inits them
        skip={"parity_sdpa": "transformers' GptOssForCausalLM refuses sdpa (_supports_sdpa is False: sinks)"},
    ),
    "qwen3_next": Row(
        lambda: Qwen3NextConfig(**QWEN3_NEXT),
        sp_overrides=HYBRID_SP,
        perturb=OFFSET_NORMS,
        torch_fallback=GDN_FALLBACK,
    ),
    "qwen3_5_text": Row(
        lambda: Qwen3_5TextConfig(**_qwen3_5_text(moe=False)),
        sp_overrides=HYBRID_SP,
        perturb=OFFSET_NORMS,
        torch_fallback=GDN_FALLBACK,
    ),
    "qwen3_5_moe_text": Row(
        lambda: Qwen3_5MoeTextConfig(**_qwen3_5_text(moe=True)),
        sp_overrides=HYBRID_SP,
        perturb=OFFSET_NORMS,
        torch_fallback=GDN_FALLBACK,
    ),
    # The released Qwen3.5 checkpoints carry the VLM model type; their causal_lm class is the text model, built from
    # the text config (a text-only run of a VLM checkpoint).
    "qwen3_5": Row(
        lambda: Qwen3_5Config(text_config=_qwen3_5_text(moe=False), vision_config=dict(TINY_VISION)),
        sp_overrides=GDN_SP_OVERRIDES,
        perturb=OFFSET_NORMS,
        torch_fallback=GDN_FALLBACK,
    ),
    "qwen3_5_moe": Row(
        lambda: Qwen3_5MoeConfig(text_config=_qwen3_5_text(moe=True), vision_config=dict(TINY_VISION)),
        sp_overrides=GDN_SP_OVERRIDES,
        perturb=OFFSET_NORMS,
        torch_fallback=GDN_FALLBACK,
    ),
}
