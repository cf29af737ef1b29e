"""veomni's built-in model families: what `veomni.models.registry.MODELS` holds at import (one entry per adapter).

Kept apart from the registry's machinery so that adding a family touches only this table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from veomni.models.registry import ModelRegistry


def register_builtin(registry: ModelRegistry) -> None:
    """Register veomni's adapters (one entry per model family) in ``registry``."""
    families = (
        (
            "llama",
            "Llama",
            "transformers.models.llama.configuration_llama:LlamaConfig",
            {"sp", "fused_kernels"},
        ),
        (
            "qwen2",
            "Qwen2",
            "transformers.models.qwen2.configuration_qwen2:Qwen2Config",
            {"sp", "fused_kernels"},
        ),
        (
            "qwen3",
            "Qwen3",
            "transformers.models.qwen3.configuration_qwen3:Qwen3Config",
            {"sp", "fused_kernels"},
        ),
        (
            "seed_oss",
            "SeedOss",
            "transformers.models.seed_oss.configuration_seed_oss:SeedOssConfig",
            {"sp", "fused_kernels"},
        ),
        (
            "qwen3_moe",
            "Qwen3Moe",
            "transformers.models.qwen3_moe.configuration_qwen3_moe:Qwen3MoeConfig",
            {"sp", "ep", "fused_kernels"},
        ),
    )
    for model_type, prefix, config, fast_paths in families:
        module = f"veomni.models.{model_type}.generated.patched_modeling_{model_type}"
        registry.register_config(model_type, config)
        registry.register_model(
            model_type,
            {
                "causal_lm": f"{module}:{prefix}ForCausalLM",
                "base": f"{module}:{prefix}Model",
                "sequence_classification": f"{module}:{prefix}ForSequenceClassification",
                "token_classification": f"{module}:{prefix}ForTokenClassification",
                "question_answering": f"{module}:{prefix}ForQuestionAnswering",
            },
            fast_paths=fast_paths,
        )
    # DeepSeek-V3 (and Moonlight / Kimi-class checkpoints with model_type deepseek_v3): transformers has no
    # question-answering head for it.
    deepseek_v3 = "veomni.models.deepseek_v3.generated.patched_modeling_deepseek_v3"
    registry.register_config(
        "deepseek_v3", "transformers.models.deepseek_v3.configuration_deepseek_v3:DeepseekV3Config"
    )
    registry.register_model(
        "deepseek_v3",
        {
            "causal_lm": f"{deepseek_v3}:DeepseekV3ForCausalLM",
            "base": f"{deepseek_v3}:DeepseekV3Model",
            "sequence_classification": f"{deepseek_v3}:DeepseekV3ForSequenceClassification",
            "token_classification": f"{deepseek_v3}:DeepseekV3ForTokenClassification",
        },
        fast_paths={"sp", "ep", "fused_kernels"},
    )
    # Gemma 3 text model (gemma3_text): sliding-window + global layers, (1 + w) RMSNorm, GELU-tanh MLP; transformers
    # has no token-classification or question-answering head for it.
    gemma3 = "veomni.models.gemma3.generated.patched_modeling_gemma3"
    registry.register_config(
        "gemma3_text", "transformers.models.gemma3.configuration_gemma3:Gemma3TextConfig"
    )
    registry.register_model(
        "gemma3_text",
        {
            "causal_lm": f"{gemma3}:Gemma3ForCausalLM",
            "base": f"{gemma3}:Gemma3TextModel",
            "sequence_classification": f"{gemma3}:Gemma3TextForSequenceClassification",
        },
        fast_paths={"sp", "fused_kernels"},
    )
    # GPT-OSS: no question-answering head upstream; sinks and sliding windows need a capable attention backend
    # (checked at build time), the experts run the moe_experts clamped_* kernels.
    gpt_oss = "veomni.models.gpt_oss.generated.patched_modeling_gpt_oss"
    registry.register_config("gpt_oss", "transformers.models.gpt_oss.configuration_gpt_oss:GptOssConfig")
    registry.register_model(
        "gpt_oss",
        {
            "causal_lm": f"{gpt_oss}:GptOssForCausalLM",
            "base": f"{gpt_oss}:GptOssModel",
            "sequence_classification": f"{gpt_oss}:GptOssForSequenceClassification",
            "token_classification": f"{gpt_oss}:GptOssForTokenClassification",
        },
        fast_paths={"sp", "ep", "fused_kernels"},
    )
    # Qwen3-VL: a VLM (no causal_lm entry: its class is the image-text-to-text one); no SP yet (refused in forward).
    qwen3_vl = "veomni.models.qwen3_vl.generated.patched_modeling_qwen3_vl"
    registry.register_config("qwen3_vl", "transformers.models.qwen3_vl.configuration_qwen3_vl:Qwen3VLConfig")
    registry.register_model(
        "qwen3_vl",
        {
            "image_text_to_text": f"{qwen3_vl}:Qwen3VLForConditionalGeneration",
            "base": f"{qwen3_vl}:Qwen3VLModel",
        },
        fast_paths={"sp", "fused_kernels"},
    )
    # Qwen3-VL-MoE: the Qwen3-VL adapter plus routed experts (EP over the language model's experts).
    qwen3_vl_moe = "veomni.models.qwen3_vl_moe.generated.patched_modeling_qwen3_vl_moe"
    registry.register_config(
        "qwen3_vl_moe", "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe:Qwen3VLMoeConfig"
    )
    registry.register_model(
        "qwen3_vl_moe",
        {
            "image_text_to_text": f"{qwen3_vl_moe}:Qwen3VLMoeForConditionalGeneration",
            "base": f"{qwen3_vl_moe}:Qwen3VLMoeModel",
        },
        fast_paths={"sp", "ep", "fused_kernels"},
    )
    # Qwen2.5-Omni thinker (text + image + video + audio in, text out); talker / token2wav are not built. SP: the
    # LM and the audio tower run on slices (the ViT runs whole on every SP rank).
    qwen2_5_omni = "veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni"
    registry.register_config(
        "qwen2_5_omni_thinker",
        "transformers.models.qwen2_5_omni.configuration_qwen2_5_omni:Qwen2_5OmniThinkerConfig",
    )
    # A full Omni checkpoint (model_type qwen2_5_omni): transformers' thinker config reads its thinker_config, so
    # it builds the thinker; the thinker recipe strips "thinker." and talker / token2wav keys are ignored and logged.
    registry.register_config(
        "qwen2_5_omni", "transformers.models.qwen2_5_omni.configuration_qwen2_5_omni:Qwen2_5OmniThinkerConfig"
    )
    registry.register_model(
        "qwen2_5_omni_thinker",
        {"any_to_any": f"{qwen2_5_omni}:Qwen2_5OmniThinkerForConditionalGeneration"},
        fast_paths={"sp"},
    )
    # Qwen3-Omni-MoE thinker: Qwen3-VL's vision tower, routed experts (EP), the audio tower with SP; the talker and
    # code2wav are not built. A full Omni checkpoint (model_type qwen3_omni_moe) builds the thinker from its
    # thinker_config; the thinker recipe strips "thinker." and talker / code2wav keys are ignored and logged.
    qwen3_omni_moe = "veomni.models.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe"
    for model_type in ("qwen3_omni_moe_thinker", "qwen3_omni_moe"):
        registry.register_config(
            model_type,
            "transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe:Qwen3OmniMoeThinkerConfig",
        )
    registry.register_model(
        "qwen3_omni_moe_thinker",
        {"any_to_any": f"{qwen3_omni_moe}:Qwen3OmniMoeThinkerForConditionalGeneration"},
        fast_paths={"sp", "ep", "fused_kernels"},
    )

    # Qwen2-VL and Qwen2.5-VL: VLMs on the Qwen3-VL machinery (ViT SP, dummy tower pass); Qwen2.5-VL's windowed
    # tower takes its window layout from the collator.
    for model_type, prefix, config_name in (
        ("qwen2_vl", "Qwen2VL", "Qwen2VLConfig"),
        ("qwen2_5_vl", "Qwen2_5_VL", "Qwen2_5_VLConfig"),
    ):
        module = f"veomni.models.{model_type}.generated.patched_modeling_{model_type}"
        registry.register_config(
            model_type, f"transformers.models.{model_type}.configuration_{model_type}:{config_name}"
        )
        registry.register_model(
            model_type,
            {
                "image_text_to_text": f"{module}:{prefix}ForConditionalGeneration",
                "base": f"{module}:{prefix}Model",
            },
            fast_paths={"sp", "fused_kernels"},
        )
    # Qwen3-Next: Gated DeltaNet + gated full attention hybrid with routed + shared experts.
    qwen3_next = "veomni.models.qwen3_next.generated.patched_modeling_qwen3_next"
    registry.register_config(
        "qwen3_next", "transformers.models.qwen3_next.configuration_qwen3_next:Qwen3NextConfig"
    )
    registry.register_model(
        "qwen3_next",
        {
            "causal_lm": f"{qwen3_next}:Qwen3NextForCausalLM",
            "base": f"{qwen3_next}:Qwen3NextModel",
            "sequence_classification": f"{qwen3_next}:Qwen3NextForSequenceClassification",
            "token_classification": f"{qwen3_next}:Qwen3NextForTokenClassification",
            "question_answering": f"{qwen3_next}:Qwen3NextForQuestionAnswering",
        },
        fast_paths={"sp", "ep", "fused_kernels"},
    )
    # Qwen3.5 text model (Gated DeltaNet hybrid, dense MLP); its VLM (qwen3_5) is registered below.
    qwen3_5 = "veomni.models.qwen3_5.generated.patched_modeling_qwen3_5"
    registry.register_config(
        "qwen3_5_text", "transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5TextConfig"
    )
    registry.register_model(
        "qwen3_5_text",
        {
            "causal_lm": f"{qwen3_5}:Qwen3_5ForCausalLM",
            "base": f"{qwen3_5}:Qwen3_5TextModel",
            "sequence_classification": f"{qwen3_5}:Qwen3_5TextForSequenceClassification",
        },
        fast_paths={"sp", "fused_kernels"},
    )
    # Qwen3.5-MoE text model: Qwen3.5's layers with routed + shared experts (EP); its VLM (qwen3_5_moe) is below.
    qwen3_5_moe = "veomni.models.qwen3_5_moe.generated.patched_modeling_qwen3_5_moe"
    registry.register_config(
        "qwen3_5_moe_text", "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe:Qwen3_5MoeTextConfig"
    )
    registry.register_model(
        "qwen3_5_moe_text",
        {"causal_lm": f"{qwen3_5_moe}:Qwen3_5MoeForCausalLM", "base": f"{qwen3_5_moe}:Qwen3_5MoeTextModel"},
        fast_paths={"sp", "ep", "fused_kernels"},
    )
    # Qwen3.5 / Qwen3.5-MoE VLMs: the Qwen3-VL tower (no deepstack; ViT SP, dummy pass) before the hybrid LMs above,
    # in the same generated modules.
    registry.register_config("qwen3_5", "transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5Config")
    registry.register_model(
        "qwen3_5",
        {
            "image_text_to_text": f"{qwen3_5}:Qwen3_5ForConditionalGeneration",
            "base": f"{qwen3_5}:Qwen3_5Model",
            # Text-only training of a released VLM checkpoint, as transformers' AutoModelForCausalLM allows.
            "causal_lm": f"{qwen3_5}:Qwen3_5ForCausalLM",
        },
        fast_paths={"sp", "fused_kernels"},
    )
    registry.register_config(
        "qwen3_5_moe", "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe:Qwen3_5MoeConfig"
    )
    registry.register_model(
        "qwen3_5_moe",
        {
            "image_text_to_text": f"{qwen3_5_moe}:Qwen3_5MoeForConditionalGeneration",
            "base": f"{qwen3_5_moe}:Qwen3_5MoeModel",
            "causal_lm": f"{qwen3_5_moe}:Qwen3_5MoeForCausalLM",
        },
        fast_paths={"sp", "ep", "fused_kernels"},
    )
