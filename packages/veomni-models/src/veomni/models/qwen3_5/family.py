"""The qwen3_5 family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import VISION_LORA, DataRules, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen3_5.generated.patched_modeling_qwen3_5"

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
    name="qwen3_5",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3_5_text",
            config="transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5TextConfig",
            classes={
                "causal_lm": f"{_MODULE}:Qwen3_5ForCausalLM",
                "base": f"{_MODULE}:Qwen3_5TextModel",
                "sequence_classification": f"{_MODULE}:Qwen3_5TextForSequenceClassification",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA),
            no_async_ulysses=NO_ASYNC_ULYSSES,
        ),
        ModelTypeSpec(
            model_type="qwen3_5",
            config="transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5Config",
            classes={
                "image_text_to_text": f"{_MODULE}:Qwen3_5ForConditionalGeneration",
                "base": f"{_MODULE}:Qwen3_5Model",
                "causal_lm": f"{_MODULE}:Qwen3_5ForCausalLM",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA),
            no_async_ulysses=NO_ASYNC_ULYSSES,
            data=DATA_VISION,
        ),
    ),
    patch_configs=("veomni.models.qwen3_5.patch_config",),
)
