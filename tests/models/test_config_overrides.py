"""Model-config keys are checked against the config class (transformers stores unknown ones silently)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2_5_VLConfig, Qwen3Config, Qwen3MoeConfig

from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.config_keys import _modeling_reads, accepted_config_keys
from veomni.models.registry import MODELS, check_config_keys


def tiny_qwen3() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip


def test_transformers_alone_keeps_a_typo_as_a_dead_attribute():
    # Why the check exists: this "works" and builds the default depth.
    config = Qwen3Config(num_hiden_layers=2)
    assert config.num_hiden_layers == 2 and config.num_hidden_layers != 2


def test_build_model_refuses_a_typo_with_a_suggestion():
    with pytest.raises(ValueError) as err:
        build_model(tiny_qwen3(), ops=OpsConfig(), config_overrides={"num_hiden_layers": 1})
    text = str(err.value)
    assert "'num_hiden_layers' is not a key of Qwen3Config" in text
    assert "did you mean 'num_hidden_layers'?" in text


def test_build_model_applies_valid_overrides():
    model = build_model(tiny_qwen3(), ops=OpsConfig(), config_overrides={"num_hidden_layers": 1})
    assert len(model.model.layers) == 1 and model.config.num_hidden_layers == 1


def test_load_config_checks_overrides_from_a_path_and_an_object(tmp_path):
    tiny_qwen3().save_pretrained(tmp_path)
    for source in (tmp_path, tiny_qwen3()):
        with pytest.raises(ValueError, match="did you mean 'num_hidden_layers'"):
            MODELS.load_config(source, num_hiden_layers=1)
        with pytest.raises(ValueError, match="'max_length' .* generation setting"):
            MODELS.load_config(source, max_length=5)
        with pytest.raises(ValueError, match="'rope_theta' .* read only when the config is built"):
            MODELS.load_config(source, rope_theta=5.0)
        assert MODELS.load_config(source, num_hidden_layers=3).num_hidden_layers == 3


def test_attribute_map_aliases_are_keys():
    config = MODELS.load_config(GPT2Config(), num_hidden_layers=3, n_head=2)
    assert config.n_layer == 3 and config.num_attention_heads == 2
    check_config_keys("gpt2", {"n_layer": 1, "num_hidden_layers": 1, "n_embd": 8}, "model.config")
    with pytest.raises(ValueError, match="'n_layers' is not a key of GPT2Config; did you mean 'n_layer'"):
        check_config_keys("gpt2", ["n_layers"], "model.config")


def test_init_stage_takes_construction_keywords():
    # A recipe's inline mapping goes to the config's constructor, which folds rope_theta into rope_parameters.
    check_config_keys(
        "qwen3", {"rope_theta": 1e6, "torch_dtype": "bfloat16", "num_labels": 3}, "model.config"
    )
    with pytest.raises(ValueError) as err:
        check_config_keys(
            "qwen3", {"num_hiden_layers": 2, "hiden_size": 8, "rope_theta": 1.0}, "model.config"
        )
    text = str(err.value)
    assert text.startswith("model.config: 2 unknown key(s) for Qwen3Config (model_type 'qwen3')")
    assert "did you mean 'num_hidden_layers'" in text and "did you mean 'hidden_size'" in text
    with pytest.raises(ValueError, match="unknown model_type 'no_such_type'"):
        check_config_keys("no_such_type", {}, "model.config")
    with pytest.raises(ValueError, match="model_type selects the config class"):
        check_config_keys(Qwen3Config, ["model_type"], "model.config")


def test_composite_configs_take_sub_config_keys_nested_or_dotted():
    check_config_keys(
        Qwen2_5_VLConfig,
        {"text_config": {"num_hidden_layers": 2, "model_type": "qwen2_5_vl_text"}, "vision_config.depth": 2,
         "image_token_id": 7},
        "model.config",
    )  # fmt: skip
    with pytest.raises(ValueError) as err:
        check_config_keys(Qwen2_5_VLConfig, {"num_hidden_layers": 2}, "model.config")
    assert "write vision_config.num_hidden_layers or text_config.num_hidden_layers" in str(err.value)
    with pytest.raises(
        ValueError, match="'text_config.num_hiden_layers' is not a key of Qwen2_5_VLTextConfig; "
    ):
        check_config_keys(Qwen2_5_VLConfig, {"text_config": {"num_hiden_layers": 2}}, "model.config")
    with pytest.raises(ValueError, match="'text_config' is not one of its sub-configs"):
        check_config_keys(Qwen3Config, ["text_config.num_hidden_layers"], "model.config")
    with pytest.raises(ValueError, match="text_config: expected a mapping of Qwen2_5_VLTextConfig keys"):
        check_config_keys(Qwen2_5_VLConfig, {"text_config": 3}, "model.config")

    config = MODELS.load_config(
        Qwen2_5_VLConfig(), text_config={"num_hidden_layers": 3}, **{"vision_config.depth": 2}
    )
    assert config.text_config.num_hidden_layers == 3 and config.vision_config.depth == 2


@pytest.mark.parametrize("cls", [Qwen3Config, Qwen3MoeConfig, LlamaConfig, GPT2Config, Qwen2_5_VLConfig])
def test_every_override_key_is_an_attribute_or_read_by_the_model(cls):
    # Accepting a key that a default config does not have, and that no model code reads, would accept exactly
    # the silent dead attribute.
    default = cls()
    keys = accepted_config_keys(cls, "override")
    assert {"num_hidden_layers", "dtype"} & keys
    missing = sorted(k for k in keys if not hasattr(default, k) and k not in _modeling_reads(cls))
    assert not missing, missing


def test_optional_keys_the_modeling_code_reads_are_accepted():
    # Qwen3MoeConfig declares no head_dim; the attention reads getattr(config, "head_dim", hidden // heads).
    assert "head_dim" not in vars(Qwen3MoeConfig())
    check_config_keys("qwen3_moe", {"head_dim": 16, "num_experts": 4}, "model.config")
    assert MODELS.load_config(Qwen3MoeConfig(), head_dim=16).head_dim == 16
    with pytest.raises(
        ValueError, match="'head_dims' is not a key of Qwen3MoeConfig; did you mean 'head_dim'"
    ):
        check_config_keys("qwen3_moe", {"head_dims": 16}, "model.config")


def test_dtype_override_is_not_confused_with_the_build_dtype():
    model = build_model(
        tiny_qwen3(), ops=OpsConfig(), dtype=torch.float32, config_overrides={"use_cache": False}
    )
    assert model.config.use_cache is False


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_rope_override_keeps_the_checkpoints_rope_theta(key):
    # The usual context-extension override names the scaling, not the base: it must not drop the model's
    # rope_theta (transformers' setter replaces the whole dict, leaving rope_theta None and the rotary init
    # crashing), nor be mutated in the caller's recipe.
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    base = Qwen3Config(
        **{**tiny_qwen3().to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    scaling = {"rope_type": "linear", "factor": 2.0}
    model = build_model(base, ops=OpsConfig(), config_overrides={key: scaling})
    assert scaling == {"rope_type": "linear", "factor": 2.0}
    assert model.config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    want = Qwen3Config(**{**tiny_qwen3().to_dict(), "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert torch.equal(model.model.rotary_emb.inv_freq, Qwen3RotaryEmbedding(want).inv_freq)


def test_a_rope_override_missing_a_required_key_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"config overrides: rope_parameters .*'factor'"):
        MODELS.load_config(tiny_qwen3(), rope_parameters={"rope_type": "linear"})
