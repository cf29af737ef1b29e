"""The glm4_moe family's declaration (`veomni.models.family.ModelFamily`): GLM-4.5-style MoE."""

from __future__ import annotations

from veomni.models.family import MOE_DEFAULT, ModelFamily, ModelTypeSpec, TrainingHooks, decoder_lora

_MODULE = "veomni.models.glm4_moe.generated.patched_modeling_glm4_moe"

FAMILY = ModelFamily(
    name="glm4_moe",
    model_types=(
        ModelTypeSpec(
            model_type="glm4_moe",
            config="transformers.models.glm4_moe.configuration_glm4_moe:Glm4MoeConfig",
            # transformers has only the causal LM and the base model for glm4_moe (no classification or QA heads).
            classes={"causal_lm": f"{_MODULE}:Glm4MoeForCausalLM", "base": f"{_MODULE}:Glm4MoeModel"},
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(default=MOE_DEFAULT, experts=True),
            async_ulysses=(f"{_MODULE}:Glm4MoeAttention",),
        ),
    ),
    patch_configs=("veomni.models.glm4_moe.patch_config",),
    # The router is DeepSeek-V3's (sigmoid + e_score_correction_bias, returns (logits, weights, indices)), so the
    # same aux-loss-free load counters and sign rule apply.
    hooks=TrainingHooks(balanced_routers="veomni.models.moe.aux_free_balance:attach_load_counters"),
)
