"""The llama family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.llama.generated.patched_modeling_llama"

FAMILY = ModelFamily(
    name="llama",
    model_types=(
        ModelTypeSpec(
            model_type="llama",
            config="transformers.models.llama.configuration_llama:LlamaConfig",
            classes={
                "causal_lm": f"{_MODULE}:LlamaForCausalLM",
                "base": f"{_MODULE}:LlamaModel",
                "sequence_classification": f"{_MODULE}:LlamaForSequenceClassification",
                "token_classification": f"{_MODULE}:LlamaForTokenClassification",
                "question_answering": f"{_MODULE}:LlamaForQuestionAnswering",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(),
            no_async_ulysses="LlamaAttention's patched forward has no async branch (only its RoPE call is patched)",
        ),
    ),
    patch_configs=("veomni.models.llama.patch_config",),
)
