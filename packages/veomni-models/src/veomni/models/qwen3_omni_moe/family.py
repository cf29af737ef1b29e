"""The qwen3_omni_moe family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import (
    AUDIO_LORA,
    MOE_DEFAULT,
    VISION_LORA,
    DataRules,
    ModelFamily,
    ModelTypeSpec,
    decoder_lora,
)

_MODULE = "veomni.models.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe"

DATA_OMNI = DataRules(
    encoder="audio_visual",
    positions="veomni.models.qwen3_omni_moe.data_rules:positions",
    video_rule="veomni.models.qwen3_omni_moe.data_rules:video_rule",
    audio_tokens="veomni.models.qwen3_omni_moe.data_rules:audio_tokens",
)
"""How the data pipeline lays out this family's multimodal rows."""

FAMILY = ModelFamily(
    name="qwen3_omni_moe",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3_omni_moe_thinker",
            config="transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe:Qwen3OmniMoeThinkerConfig",
            classes={
                "any_to_any": f"{_MODULE}:Qwen3OmniMoeThinkerForConditionalGeneration",
            },
            fast_paths={"sp", "ep", "fused_kernels"},
            lora=decoder_lora(extra={**VISION_LORA, **AUDIO_LORA}, default=MOE_DEFAULT, experts=True),
            no_async_ulysses="the thinker's text attention has no async branch (only its mrope call is "
            "patched)",
            data=DATA_OMNI,
        ),
        ModelTypeSpec(
            model_type="qwen3_omni_moe",
            config="transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe:Qwen3OmniMoeThinkerConfig",
        ),
    ),
    patch_configs=("veomni.models.qwen3_omni_moe.patch_config",),
)
