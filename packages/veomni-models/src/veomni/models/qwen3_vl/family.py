"""The qwen3_vl family's declaration (`veomni.models.family.ModelFamily`)."""

from __future__ import annotations

from veomni.models.family import VISION_LORA, DataRules, ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.qwen3_vl.generated.patched_modeling_qwen3_vl"

DATA_VISION = DataRules(
    encoder="vision",
    positions="veomni.models.qwen3_vl.data_rules:positions",
    video_rule="veomni.models.qwen3_vl.data_rules:video_rule",
)
"""How the data pipeline lays out this family's multimodal rows."""

FAMILY = ModelFamily(
    name="qwen3_vl",
    model_types=(
        ModelTypeSpec(
            model_type="qwen3_vl",
            config="transformers.models.qwen3_vl.configuration_qwen3_vl:Qwen3VLConfig",
            classes={
                "image_text_to_text": f"{_MODULE}:Qwen3VLForConditionalGeneration",
                "base": f"{_MODULE}:Qwen3VLModel",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(extra=VISION_LORA),
            no_async_ulysses="Qwen3VLTextAttention's patched forward has no async branch (only its mrope call is "
            "patched)",
            data=DATA_VISION,
        ),
    ),
    patch_configs=("veomni.models.qwen3_vl.patch_config",),
)
