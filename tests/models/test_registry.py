"""Model registries: built-in adapters, lazy "module:attr" resolution, duplicates, the Auto fallback warning."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from transformers import GPT2Config, MistralConfig, Qwen3Config, Qwen3MoeConfig
from transformers.models.mistral.modeling_mistral import MistralForCausalLM

from veomni.models.registry import FAST_PATHS, MODELS, ModelRegistry, resolve_target


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
    with pytest.raises(ValueError, match="for tasks \\['causal_lm'\\], not 'base'"):
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
    with pytest.raises(ValueError, match="has no 'model_type'"):
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
