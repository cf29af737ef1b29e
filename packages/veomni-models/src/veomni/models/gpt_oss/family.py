"""The gpt_oss family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.gpt_oss.generated.patched_modeling_gpt_oss"

FAMILY = ModelFamily(
    name="gpt_oss",
    model_types=(
        ModelTypeSpec(
            model_type="gpt_oss",
            config="transformers.models.gpt_oss.configuration_gpt_oss:GptOssConfig",
            classes={
                "causal_lm": f"{_MODULE}:GptOssForCausalLM",
                "base": f"{_MODULE}:GptOssModel",
                "sequence_classification": f"{_MODULE}:GptOssForSequenceClassification",
                "token_classification": f"{_MODULE}:GptOssForTokenClassification",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(),
            no_async_ulysses="GptOssAttention runs upstream's forward (sinks and sliding windows through the "
            "attention interface), which has no async branch",
        ),
    ),
    patch_configs=("veomni.models.gpt_oss.patch_config",),
)
