"""The deepseek_v3 family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import MOE_DEFAULT, ModelFamily, ModelTypeSpec, TrainingHooks, decoder_lora

_MODULE = "veomni.models.deepseek_v3.generated.patched_modeling_deepseek_v3"

FAMILY = ModelFamily(
    name="deepseek_v3",
    model_types=(
        ModelTypeSpec(
            model_type="deepseek_v3",
            config="transformers.models.deepseek_v3.configuration_deepseek_v3:DeepseekV3Config",
            classes={
                "causal_lm": f"{_MODULE}:DeepseekV3ForCausalLM",
                "base": f"{_MODULE}:DeepseekV3Model",
                "sequence_classification": f"{_MODULE}:DeepseekV3ForSequenceClassification",
                "token_classification": f"{_MODULE}:DeepseekV3ForTokenClassification",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(default=MOE_DEFAULT, experts=True),
            no_async_ulysses="MLA has no async branch: q and k come from low-rank latents and share one rotary key "
            "across heads, values have a head size of their own",
        ),
    ),
    patch_configs=("veomni.models.deepseek_v3.patch_config",),
    hooks=TrainingHooks(balanced_routers="veomni.models.moe.aux_free_balance:attach_load_counters"),
)
