"""The qwen3_next family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import MOE_DEFAULT, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen3_next.generated.patched_modeling_qwen3_next"

NO_ASYNC_ULYSSES = (
    "its Gated DeltaNet layers run their own head-split exchange (veomni.models.qwen3_next.sp) and its gated "
    "full attention (partial RoPE, output gate) has no async branch"
)
"""Why ``parallel.async_ulysses`` is refused for this family."""

FAMILY = ModelFamily(
    name="qwen3_next",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3_next",
            config="transformers.models.qwen3_next.configuration_qwen3_next:Qwen3NextConfig",
            classes={
                "causal_lm": f"{_MODULE}:Qwen3NextForCausalLM",
                "base": f"{_MODULE}:Qwen3NextModel",
                "sequence_classification": f"{_MODULE}:Qwen3NextForSequenceClassification",
                "token_classification": f"{_MODULE}:Qwen3NextForTokenClassification",
                "question_answering": f"{_MODULE}:Qwen3NextForQuestionAnswering",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(default=MOE_DEFAULT, experts=True),
            no_async_ulysses=NO_ASYNC_ULYSSES,
        ),
    ),
    patch_configs=("veomni.models.qwen3_next.patch_config",),
)
