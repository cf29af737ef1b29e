"""The seed_oss family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.seed_oss.generated.patched_modeling_seed_oss"

FAMILY = ModelFamily(
    name="seed_oss",
    model_types=(
        ModelTypeSpec(
            model_type="seed_oss",
            config="transformers.models.seed_oss.configuration_seed_oss:SeedOssConfig",
            classes={
                "causal_lm": f"{_MODULE}:SeedOssForCausalLM",
                "base": f"{_MODULE}:SeedOssModel",
                "sequence_classification": f"{_MODULE}:SeedOssForSequenceClassification",
                "token_classification": f"{_MODULE}:SeedOssForTokenClassification",
                "question_answering": f"{_MODULE}:SeedOssForQuestionAnswering",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(),
            no_async_ulysses="SeedOssAttention's patched forward has no async branch (only its RoPE call is patched)",
        ),
    ),
    patch_configs=("veomni.models.seed_oss.patch_config",),
)
