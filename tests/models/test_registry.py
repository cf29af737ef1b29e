"""Model registries: built-in adapters, lazy "module:attr" resolution, duplicates, the Auto fallback warning."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys

import pytest
from transformers import GPT2Config, MistralConfig, Qwen3Config, Qwen3MoeConfig
from transformers.models.mistral.modeling_mistral import MistralForCausalLM

from veomni.models.registry import FAST_PATHS, MODELS, TASKS, DiffusersConfig, ModelRegistry, resolve_target


def test_builtin_adapters_resolve_to_generated_classes():
    assert {"llama", "qwen2", "qwen3", "qwen3_moe"} <= set(MODELS.model_types())
    qwen3 = MODELS.model_class(Qwen3Config(), "causal_lm")
    assert qwen3.registered and qwen3.cls.__module__ == "veomni.models.qwen3.generated.patched_modeling_qwen3"
    assert qwen3.cls.__name__ == "Qwen3ForCausalLM" and qwen3.fast_paths == {"sp", "fused_kernels"}
    moe = MODELS.model_class(Qwen3MoeConfig(), "causal_lm")
    assert moe.fast_paths == {"sp", "ep", "fused_kernels"} and hasattr(moe.cls, "get_parallel_plan")
    assert MODELS.model_class(Qwen3Config(), "base").cls.__name__ == "Qwen3Model"
    assert MODELS.config_class("qwen3_moe") is Qwen3MoeConfig


def test_entries_are_resolved_lazily_and_broken_ones_fail_loudly():
    reg = ModelRegistry()
    reg.register_model("qwen3", {"causal_lm": "veomni_no_such_module.sub:Cls"}, fast_paths=set())
    assert "veomni_no_such_module" not in sys.modules  # registering imported nothing
    with pytest.raises(ImportError, match="veomni_no_such_module"):
        reg.model_class(Qwen3Config(), "causal_lm")  # registered: no silent fallback to transformers
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        resolve_target("json:Nope")
    assert resolve_target("json:dumps") is json.dumps


def test_duplicates_and_malformed_entries_are_errors():
    reg = ModelRegistry()
    reg.register_model("m", {"causal_lm": "a:B"}, fast_paths={"sp"})
    with pytest.raises(ValueError, match="already registered"):
        reg.register_model("m", {"base": "a:C"}, fast_paths=set())
    reg.register_config("m", "a:Cfg")
    with pytest.raises(ValueError, match="already registered"):
        reg.register_config("m", "a:Cfg")
    reg.register_processor("MyProcessor", "a:P")
    with pytest.raises(ValueError, match="already registered"):
        reg.register_processor("MyProcessor", "a:P")
    with pytest.raises(ValueError, match="'package.module:Attribute'"):
        reg.register_model("n", {"causal_lm": "no_colon"}, fast_paths=set())
    with pytest.raises(ValueError, match="unknown task 'chat'"):
        reg.register_model("n", {"chat": "a:B"}, fast_paths=set())
    with pytest.raises(ValueError, match="unknown fast paths"):
        reg.register_model("n", {"causal_lm": "a:B"}, fast_paths={"turbo"})
    with pytest.raises(ValueError, match="'m' does not support task 'base': .* for tasks \\['causal_lm'\\]"):
        reg.model_class(type("C", (), {"model_type": "m"})(), "base")


def test_unknown_model_type_falls_back_to_auto_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="veomni.models.registry"):
        resolved = MODELS.model_class(MistralConfig(), "causal_lm")
    assert resolved.cls is MistralForCausalLM and not resolved.registered
    text = caplog.text
    assert "'mistral' is not registered with veomni" in text
    for path in ("sp", "ep", "fused_kernels"):
        if path in resolved.fast_paths:
            assert "still works through HF's attention interface" in text
        else:
            assert FAST_PATHS[path] in text
    assert FAST_PATHS["ep"] in text and FAST_PATHS["fused_kernels"] in text


def test_unknown_everywhere_is_an_error():
    with pytest.raises(ValueError, match="transformers has no MODEL_FOR_QUESTION_ANSWERING_MAPPING class"):
        MODELS.model_class(type("Cfg", (GPT2Config,), {"model_type": "no_such_type"})(), "question_answering")
    with pytest.raises(ValueError, match="unknown task"):
        MODELS.model_class(Qwen3Config(), "chat")


def test_load_config_uses_the_registered_class_and_copies(tmp_path):
    cfg = Qwen3Config(hidden_size=32, num_attention_heads=4)
    cfg.save_pretrained(tmp_path)
    loaded = MODELS.load_config(tmp_path, num_hidden_layers=3)
    assert type(loaded) is Qwen3Config and loaded.hidden_size == 32 and loaded.num_hidden_layers == 3
    copy = MODELS.load_config(cfg, hidden_size=64)
    assert copy.hidden_size == 64 and cfg.hidden_size == 32
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="has neither 'model_type' \\(transformers\\) nor '_class_name'"):
        MODELS.load_config(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MODELS.load_config(tmp_path / "nowhere")


def test_processors_by_class_name():
    reg = ModelRegistry()
    reg.register_processor("Thing", "json:JSONDecoder")
    assert reg.processor_class("Thing") is json.JSONDecoder
    from transformers import Qwen2VLProcessor

    assert reg.processor_class("Qwen2VLProcessor") is Qwen2VLProcessor
    with pytest.raises(ValueError, match="neither registered with veomni"):
        reg.processor_class("NoSuchProcessor")


def test_tasks_cover_the_recipe_modalities():
    assert {"causal_lm", "image_text_to_text", "any_to_any", "diffusion_transformer"} <= set(TASKS)
    from transformers import LlavaConfig, Qwen2_5OmniThinkerConfig
    from transformers.models.llava.modeling_llava import LlavaForConditionalGeneration

    from veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni import (
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    thinker = MODELS.model_class(Qwen2_5OmniThinkerConfig(), "any_to_any")
    assert thinker.cls is Qwen2_5OmniThinkerForConditionalGeneration and thinker.registered
    # An unregistered VLM falls back to transformers' image-text-to-text class (qwen2_vl is registered now).
    assert MODELS.model_class(LlavaConfig(), "image_text_to_text").cls is LlavaForConditionalGeneration
    assert {"any_to_any", "image_text_to_text"} <= set(MODELS.supported_tasks(LlavaConfig()))


def test_a_task_the_model_lacks_is_an_error_naming_its_tasks():
    with pytest.raises(ValueError) as err:
        MODELS.model_class(MistralConfig(), "image_text_to_text")
    text = str(err.value)
    assert (
        "model_type 'mistral' is not registered with veomni and does not support task 'image_text_to_text'"
        in text
    )
    assert "it supports ['base', 'causal_lm', 'question_answering', 'sequence_classification'" in text
    with pytest.raises(
        ValueError, match="model_type 'qwen3' does not support task 'diffusion_transformer'; it "
    ):
        MODELS.model_class(Qwen3Config(), "diffusion_transformer")
    with pytest.raises(
        ValueError, match="diffusion_transformer' models are diffusers classes keyed by _class_name"
    ):
        ModelRegistry().register_model("x", {"diffusion_transformer": "a:B"}, fast_paths=set())


def test_backend_hf_takes_transformers_class_even_when_registered(caplog):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    with caplog.at_level(logging.WARNING, logger="veomni.models.registry"):
        resolved = MODELS.model_class(Qwen3Config(), "causal_lm", backend="hf")
    assert resolved.cls is Qwen3ForCausalLM and not resolved.registered and resolved.fast_paths == frozenset()
    assert caplog.text == ""  # build_model reports what is off, once
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        MODELS.model_class(Qwen3Config(), "causal_lm", backend="fast")


def _diffusers_dir(tmp_path, class_name: str):
    folder = tmp_path / class_name
    folder.mkdir()
    values = {
        "_class_name": class_name,
        "_diffusers_version": "0.35.0",
        "num_layers": 2,
        "patch_size": [1, 2, 2],
    }
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def test_diffusers_configs_resolve_by_class_name_lazily(tmp_path):
    reg = ModelRegistry()
    reg.register_diffusers("TinyDiT", "veomni_no_such_dit_module:TinyDiT", fast_paths={"sp"})
    reg.register_diffusers("JsonDiT", "json:JSONDecoder", fast_paths=set())  # a stand-in class
    assert "veomni_no_such_dit_module" not in sys.modules
    with pytest.raises(ValueError, match="_class_name 'TinyDiT' is already registered"):
        reg.register_diffusers("TinyDiT", "a:B", fast_paths=set())

    config = reg.load_config(_diffusers_dir(tmp_path, "JsonDiT"))
    assert (
        isinstance(config, DiffusersConfig)
        and config.class_name == "JsonDiT"
        and config.values["num_layers"] == 2
    )
    resolved = reg.model_class(config, "diffusion_transformer")
    assert resolved.cls is json.JSONDecoder and resolved.registered
    assert reg.supported_tasks(config) == ["diffusion_transformer"]
    with pytest.raises(
        ValueError, match="_class_name 'JsonDiT' does not support task 'causal_lm'; it supports "
    ):
        reg.model_class(config, "causal_lm")

    assert reg.load_config(config, num_layers=4).values["num_layers"] == 4
    with pytest.raises(
        ValueError, match="'num_layer' \\(did you mean 'num_layers'\\?\\) not in the diffusers config"
    ):
        reg.load_config(config, num_layer=4)


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is not None, reason="diffusers is installed")
def test_diffusers_entries_name_the_missing_package(tmp_path):
    reg = ModelRegistry()
    reg.register_diffusers("TinyDiT", "veomni_no_such_dit_module:TinyDiT", fast_paths=set())
    for name in ("TinyDiT", "WanTransformer3DModel"):  # registered, and the diffusers fallback
        config = reg.load_config(_diffusers_dir(tmp_path, name))
        with pytest.raises(
            ImportError, match="is a diffusers model and diffusers is not installed.*\\[diffusers\\]"
        ):
            reg.model_class(config, "diffusion_transformer")


def test_the_auto_fallback_grants_sp_to_text_decoders_only():
    """A composite's vision tower calls attention per image on unsliced data: under SP it would be taken for a
    sequence shard, so a fallback VLM must not claim the SP fast path (build_model then refuses sp > 1)."""
    from transformers import LlavaConfig

    assert "sp" in MODELS.model_class(MistralConfig(), "causal_lm").fast_paths
    assert "sp" not in MODELS.model_class(LlavaConfig(), "image_text_to_text").fast_paths


def test_architecture_task_reads_the_class_a_config_names():
    assert MODELS.architecture_task(Qwen3Config(architectures=["Qwen3ForSequenceClassification"])) == (
        "sequence_classification"
    )
    assert MODELS.architecture_task(Qwen3Config()) is None  # names no class
    assert MODELS.architecture_task(Qwen3Config(architectures=["LlamaForCausalLM"])) is None
    # An unregistered model type: transformers' Auto mappings.
    assert MODELS.architecture_task(GPT2Config(architectures=["GPT2LMHeadModel"])) == "causal_lm"


def test_a_model_type_with_sp_declares_its_async_ulysses_path_or_why_not():
    from veomni.models.family import ModelTypeSpec

    sp = dict(model_type="x", config="a:C", fast_paths={"sp"})
    with pytest.raises(ValueError, match="supports sp: declare either async_ulysses .* or no_async_ulysses"):
        ModelTypeSpec(**sp)
    with pytest.raises(ValueError, match="supports sp: declare either"):
        ModelTypeSpec(**sp, async_ulysses=("a:Attention",), no_async_ulysses="why")
    with pytest.raises(ValueError, match="async_ulysses: expected a 'package.module:attribute' string"):
        ModelTypeSpec(**sp, async_ulysses=("Attention",))
    with pytest.raises(ValueError, match="declares \\['no_async_ulysses'\\] but has no 'sp'"):
        ModelTypeSpec(model_type="x", config="a:C", no_async_ulysses="why")
    assert ModelTypeSpec(**sp, no_async_ulysses="why").no_async_ulysses == "why"
    assert ModelTypeSpec(**sp, async_ulysses=["a:Attention"]).async_ulysses == ("a:Attention",)
