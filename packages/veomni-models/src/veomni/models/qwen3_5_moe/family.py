"""The qwen3_5_moe family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import VISION_LORA, DataRules, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen3_5_moe.generated.patched_modeling_qwen3_5_moe"

DATA_VISION = DataRules(
    encoder="vision",
    positions="veomni.models.qwen3_vl.data_rules:positions",
    video_rule="veomni.models.qwen3_vl.data_rules:video_rule",
)
"""How the data pipeline lays out this family's multimodal rows."""

NO_ASYNC_ULYSSES = (
    "its Gated DeltaNet layers run their own head-split exchange (veomni.models.qwen3_next.sp) and its gated "
    "full attention (partial RoPE, output gate) has no async branch"
)
"""Why ``parallel.async_ulysses`` is refused for this family's model types."""

FAMILY = ModelFamily(
    name="qwen3_5_moe",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3_5_moe_text",
            config="transformers.models.qwen3_5_moe.configuration_qwen3_5_moe:Qwen3_5MoeTextConfig",
            classes={
                "causal_lm": f"{_MODULE}:Qwen3_5MoeForCausalLM",
                "base": f"{_MODULE}:Qwen3_5MoeTextModel",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA, experts=True),
            no_async_ulysses=NO_ASYNC_ULYSSES,
        ),
        ModelTypeSpec(
            model_type="qwen3_5_moe",
            config="transformers.models.qwen3_5_moe.configuration_qwen3_5_moe:Qwen3_5MoeConfig",
            classes={
                "image_text_to_text": f"{_MODULE}:Qwen3_5MoeForConditionalGeneration",
                "base": f"{_MODULE}:Qwen3_5MoeModel",
                "causal_lm": f"{_MODULE}:Qwen3_5MoeForCausalLM",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA, experts=True),
            no_async_ulysses=NO_ASYNC_ULYSSES,
            data=DATA_VISION,
        ),
    ),
    patch_configs=("veomni.models.qwen3_5_moe.patch_config",),
)
