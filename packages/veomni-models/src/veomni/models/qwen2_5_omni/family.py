"""The qwen2_5_omni family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import AUDIO_LORA, VISION_LORA, DataRules, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni"

DATA_OMNI = DataRules(
    encoder="audio_visual",
    positions="veomni.models.qwen2_5_omni.data_rules:positions",
    video_rule="veomni.models.qwen2_5_omni.data_rules:video_rule",
    audio_tokens="veomni.models.qwen2_5_omni.data_rules:audio_tokens",
    audio_layout="veomni.models.qwen2_5_omni.data_rules:audio_layout",
)
"""How the data pipeline lays out this family's multimodal rows."""

FAMILY = ModelFamily(
    name="qwen2_5_omni",
    model_types=(
        ModelTypeSpec(
            model_type="qwen2_5_omni_thinker",
            config="transformers.models.qwen2_5_omni.configuration_qwen2_5_omni:Qwen2_5OmniThinkerConfig",
            classes={
                "any_to_any": f"{_MODULE}:Qwen2_5OmniThinkerForConditionalGeneration",
            },
            fast_paths={"sp"},
            lora=decoder_lora(extra={**VISION_LORA, **AUDIO_LORA}),
            no_async_ulysses="the thinker's text attention reuses Qwen2-VL's patched forward (mrope), which "
            "has no async branch",
            data=DATA_OMNI,
        ),
        ModelTypeSpec(
            model_type="qwen2_5_omni",
            config="transformers.models.qwen2_5_omni.configuration_qwen2_5_omni:Qwen2_5OmniThinkerConfig",
        ),
    ),
    patch_configs=("veomni.models.qwen2_5_omni.patch_config",),
)
