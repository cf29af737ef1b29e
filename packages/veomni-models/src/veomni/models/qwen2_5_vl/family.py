"""The qwen2_5_vl family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import VISION_LORA, DataRules, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen2_5_vl.generated.patched_modeling_qwen2_5_vl"

DATA_UNTIMED = DataRules(
    encoder="vision_untimed_video",
    positions="veomni.models.qwen2_vl.data_rules:positions",
    video_rule="veomni.models.qwen2_vl.data_rules:video_rule",
)
"""How the data pipeline lays out this family's multimodal rows."""

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    model_types=(
        ModelTypeSpec(
            model_type="qwen2_5_vl",
            config="transformers.models.qwen2_5_vl.configuration_qwen2_5_vl:Qwen2_5_VLConfig",
            classes={
                "image_text_to_text": f"{_MODULE}:Qwen2_5_VLForConditionalGeneration",
                "base": f"{_MODULE}:Qwen2_5_VLModel",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA),
            no_async_ulysses="its text attention reuses Qwen2-VL's patched forward (mrope), which has no async "
            "branch",
            data=DATA_UNTIMED,
        ),
    ),
    patch_configs=("veomni.models.qwen2_5_vl.patch_config",),
)
