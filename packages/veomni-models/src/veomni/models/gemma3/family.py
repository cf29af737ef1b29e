"""The gemma3 family's declaration (`veomni.models.family.ModelFamily`): Gemma 3's text model.

transformers has no token-classification or question-answering head for ``gemma3_text``. The image-text model
(``model_type: gemma3``, ``Gemma3ForConditionalGeneration``) is carried unpatched in the generated module and not
declared.
"""

from __future__ import annotations

from veomni.models.family import ModelFamily, ModelTypeSpec, decoder_lora

_MODULE = "veomni.models.gemma3.generated.patched_modeling_gemma3"

FAMILY = ModelFamily(
    name="gemma3",
    model_types=(
        ModelTypeSpec(
            model_type="gemma3_text",
            config="transformers.models.gemma3.configuration_gemma3:Gemma3TextConfig",
            classes={
                "causal_lm": f"{_MODULE}:Gemma3ForCausalLM",
                "base": f"{_MODULE}:Gemma3TextModel",
                "sequence_classification": f"{_MODULE}:Gemma3TextForSequenceClassification",
            },
            fast_paths={"sp", "fused_kernels"},
            lora=decoder_lora(),
            async_ulysses=(f"{_MODULE}:Gemma3Attention",),
        ),
    ),
    patch_configs=("veomni.models.gemma3.patch_config",),
)
