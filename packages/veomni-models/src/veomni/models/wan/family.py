"""The wan family's declaration (`veomni.models.family.ModelFamily`): diffusers' Wan2.1 DiT, with veomni's
kernels (`veomni.models.wan.kernels`) and Ulysses SP (`veomni.models.wan.sp`) bound by the diffusers build, and
the frozen condition models the ``dit`` task trains it with (`veomni.models.wan.condition`)."""

from __future__ import annotations

from veomni.models.family import DiffusionRules, ModelFamily, ModelTypeSpec

DIFFUSION = DiffusionRules(
    bind_kernels="veomni.models.wan.kernels:bind_wan_kernels",
    sequence_parallel="veomni.models.wan.sp:apply_dit_sp",
    condition_config="veomni.models.wan.condition:WanConditionConfig",
    condition_model="veomni.models.wan.condition:WanConditionModel",
    condition_error="veomni.models.wan.pipeline_dir:ConditionCheckpointError",
    condition_configs="veomni.models.wan.rules:condition_configs",
    compatibility="veomni.models.wan.rules:compatibility",
    flow_matching_inputs="veomni.models.wan.condition:flow_matching_inputs",
    weight_counts="veomni.models.wan.rules:weight_counts",
    modes={
        "t2v": "text-to-video",
        "i2v": "image-to-video (the first frame's VAE latents and CLIP image embeddings condition each sample)",
    },
)
"""What the diffusers build and the dit task ask of a Wan2.1 transformer."""

FAMILY = ModelFamily(
    name="wan",
    model_types=(
        ModelTypeSpec(
            model_type="WanTransformer3DModel",
            library="diffusers",
            classes={"diffusion_transformer": "diffusers:WanTransformer3DModel"},
            fast_paths={"sp", "fused_kernels"},
            no_async_ulysses="its Ulysses SP is its own attention processor (veomni.models.wan.sp), which has "
            "no async variant",
            diffusion=DIFFUSION,
        ),
    ),
)
