"""The qwen3 family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen3.generated.patched_modeling_qwen3"

FAMILY = ModelFamily(
    name="qwen3",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3",
            config="transformers.models.qwen3.configuration_qwen3:Qwen3Config",
            classes={
                "causal_lm": f"{_MODULE}:Qwen3ForCausalLM",
                "base": f"{_MODULE}:Qwen3Model",
                "sequence_classification": f"{_MODULE}:Qwen3ForSequenceClassification",
                "token_classification": f"{_MODULE}:Qwen3ForTokenClassification",
                "question_answering": f"{_MODULE}:Qwen3ForQuestionAnswering",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(),
            async_ulysses=(f"{_MODULE}:Qwen3Attention",),
        ),
    ),
    patch_configs=("veomni.models.qwen3.patch_config",),
)
