"""The qwen2 family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen2.generated.patched_modeling_qwen2"

FAMILY = ModelFamily(
    name="qwen2",
    model_types=(
        ModelTypeSpec(
            model_type="qwen2",
            config="transformers.models.qwen2.configuration_qwen2:Qwen2Config",
            classes={
                "causal_lm": f"{_MODULE}:Qwen2ForCausalLM",
                "base": f"{_MODULE}:Qwen2Model",
                "sequence_classification": f"{_MODULE}:Qwen2ForSequenceClassification",
                "token_classification": f"{_MODULE}:Qwen2ForTokenClassification",
                "question_answering": f"{_MODULE}:Qwen2ForQuestionAnswering",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(),
            no_async_ulysses="Qwen2Attention's patched forward has no async branch (only its RoPE call is patched)",
        ),
    ),
    patch_configs=("veomni.models.qwen2.patch_config",),
)
