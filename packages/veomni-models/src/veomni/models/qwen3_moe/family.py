"""The qwen3_moe family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import MOE_DEFAULT, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe"

FAMILY = ModelFamily(
    name="qwen3_moe",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3_moe",
            config="transformers.models.qwen3_moe.configuration_qwen3_moe:Qwen3MoeConfig",
            classes={
                "causal_lm": f"{_MODULE}:Qwen3MoeForCausalLM",
                "base": f"{_MODULE}:Qwen3MoeModel",
                "sequence_classification": f"{_MODULE}:Qwen3MoeForSequenceClassification",
                "token_classification": f"{_MODULE}:Qwen3MoeForTokenClassification",
                "question_answering": f"{_MODULE}:Qwen3MoeForQuestionAnswering",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(default=MOE_DEFAULT, experts=True),
            async_ulysses=(f"{_MODULE}:Qwen3MoeAttention",),
        ),
    ),
    patch_configs=("veomni.models.qwen3_moe.patch_config",),
)
