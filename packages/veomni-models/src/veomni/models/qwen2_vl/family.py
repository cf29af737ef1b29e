"""The qwen2_vl family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import VISION_LORA, DataRules, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen2_vl.generated.patched_modeling_qwen2_vl"

DATA_UNTIMED = DataRules(
    encoder="vision_untimed_video",
    positions="veomni.models.qwen2_vl.data_rules:positions",
    video_rule="veomni.models.qwen2_vl.data_rules:video_rule",
)
"""How the data pipeline lays out this family's multimodal rows."""

FAMILY = ModelFamily(
    name="qwen2_vl",
    model_types=(
        ModelTypeSpec(
            model_type="qwen2_vl",
            config="transformers.models.qwen2_vl.configuration_qwen2_vl:Qwen2VLConfig",
            classes={
                "image_text_to_text": f"{_MODULE}:Qwen2VLForConditionalGeneration",
                "base": f"{_MODULE}:Qwen2VLModel",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA),
            no_async_ulysses="Qwen2VLAttention's patched forward (mrope) has no async branch",
            data=DATA_UNTIMED,
        ),
    ),
    patch_configs=("veomni.models.qwen2_vl.patch_config",),
)
