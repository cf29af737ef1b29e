"""Preflight: a recipe whose parallel degrees the model cannot take fails before the data is indexed or the model
built, with a `PreflightError` naming the recipe field, what was expected and what was found."""

from __future__ import annotations

import copy
import re

import pytest
from test_loop import DENSE, MOE, tiny_recipe

from veomni.train.preflight import PreflightError, check_parallel_fit


def _probe(values: dict):
    from transformers import AutoConfig

    from veomni.train.model_setup import meta_instance

    values = dict(values)
    return meta_instance(AutoConfig.for_model(values.pop("model_type"), **values))


def test_ep_needs_a_moe_model_whose_experts_it_divides():
    dense, moe = _probe(DENSE), _probe({**MOE, "num_experts": 6})
    with pytest.raises(PreflightError, match=r"parallel.ep=2: Qwen3ForCausalLM has no experts to split"):
        check_parallel_fit(dense, {"sp"}, backend="veomni", sp=1, ep=2)
    with pytest.raises(
        PreflightError, match=r"parallel.ep=4 does not divide the 6 experts of Qwen3MoeForCausalLM"
    ):
        check_parallel_fit(moe, {"sp", "ep"}, backend="veomni", sp=1, ep=4)
    check_parallel_fit(moe, {"sp", "ep"}, backend="veomni", sp=1, ep=2)
    check_parallel_fit(dense, {"sp"}, backend="veomni", sp=2, ep=1)


def test_sp_needs_a_model_with_ulysses_attention_and_the_veomni_backend():
    dense = _probe(DENSE)
    with pytest.raises(PreflightError, match=r"parallel.sp=2: Qwen3ForCausalLM does not support Ulysses"):
        check_parallel_fit(dense, set(), backend="veomni", sp=2, ep=1)
    with pytest.raises(PreflightError, match=r"model.backend=hf .* parallel.sp=2, parallel.ep=1"):
        check_parallel_fit(dense, {"sp"}, backend="hf", sp=2, ep=1)


def _preflight_error(ctx, raw: dict) -> str:
    from veomni.train.loop import build_run
    from veomni.train.recipe import recipe_from_dict

    try:
        build_run(recipe_from_dict(raw))
    except PreflightError as err:
        return str(err)
    return "no PreflightError"


def test_ep_on_a_dense_model_fails_before_the_data_is_read(dist_pools, tmp_path):
    # The training file does not exist: reading the data would fail first if the check came after it (it used to
    # come from the model build, after the data index, as a bare ValueError).
    raw = tiny_recipe(str(tmp_path), DENSE, ep=2)
    raw["data"]["train_files"] = [str(tmp_path / "missing.jsonl")]
    errors = dist_pools.get(2, "gloo").run(_preflight_error, copy.deepcopy(raw))
    assert all("parallel.ep=2: Qwen3ForCausalLM has no experts to split" in e for e in errors), errors


@pytest.mark.parametrize(
    "parallel, message",
    [
        ({"sp": 4}, "parallel: dp_replicate*sp = 1*4 must divide the world size 2"),
        ({"dp_shard": 4}, "parallel.dp_shard=4 but 2 ranks / (dp_replicate=1 * sp=1) = 2"),
        ({"ep": 4}, "parallel: ep=4 must divide dp_shard*sp=2*1=2"),
    ],
)
def test_degrees_that_do_not_fit_the_world_are_preflight_errors(tmp_path, parallel, message):
    # A PreflightError is what the CLI reports as bad input (exit 2, no traceback); a bare ValueError is a crash.
    from veomni.train.loop import parallel_dims
    from veomni.train.recipe import recipe_from_dict

    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["parallel"].update(parallel)
    with pytest.raises(PreflightError, match=re.escape(message)):
        parallel_dims(recipe_from_dict(raw), 2)


def test_query_heads_not_a_multiple_of_kv_heads_are_refused_without_sp():
    # Without the check the run built the model, loaded its weights and failed in the first attention call.
    from transformers import AutoConfig

    from veomni.train.preflight import check_sp_heads

    values = {k: v for k, v in DENSE.items() if k != "model_type"}
    config = AutoConfig.for_model("qwen3", **{**values, "num_attention_heads": 5, "num_key_value_heads": 2})
    with pytest.raises(
        PreflightError, match=r"num_attention_heads=5 is not a multiple of num_key_value_heads=2"
    ):
        check_sp_heads(config, 1)
    check_sp_heads(AutoConfig.for_model("qwen3", **values), 1)


@pytest.mark.parametrize("where", ["inline", "overrides"])
def test_a_config_value_of_the_wrong_type_is_a_preflight_error(tmp_path, where):
    from transformers import AutoConfig

    from veomni.train.model_setup import model_config
    from veomni.train.recipe import recipe_from_dict

    raw = tiny_recipe(str(tmp_path), DENSE)
    if where == "inline":
        raw["model"]["config"]["num_hidden_layers"] = "two"
    else:
        values = {k: v for k, v in DENSE.items() if k != "model_type"}
        AutoConfig.for_model("qwen3", **values).save_pretrained(tmp_path / "config")
        raw["model"]["config"] = str(tmp_path / "config")
        raw["model"]["config_overrides"] = {"num_hidden_layers": "two"}
    with pytest.raises(PreflightError, match=r"(?s)model\.config.*num_hidden_layers.*expected int"):
        model_config(recipe_from_dict(raw))


def test_a_step_budget_the_dp_ranks_cannot_split_fails_before_the_data_is_read(dist_pools, tmp_path):
    # 768 tokens per step is 3 micro-batches of 256 on one rank, 1.5 on each of two: found only after indexing
    # the training files before, as a RecipeError the CLI did not report as bad input.
    raw = tiny_recipe(str(tmp_path), DENSE, tokens_per_step=768)
    raw["data"]["train_files"] = [str(tmp_path / "missing.jsonl")]
    errors = dist_pools.get(2, "gloo").run(_preflight_error, raw)
    assert all("train.tokens_per_step=768 is not a multiple of" in e for e in errors), errors


def test_a_resume_path_that_is_no_checkpoint_fails_before_the_data_is_read(dist_pools, tmp_path):
    # It used to surface as a FileNotFoundError traceback once the data was indexed and the model built.
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["checkpoint"]["resume"] = str(tmp_path / "step_00000100")
    raw["data"]["train_files"] = [str(tmp_path / "missing.jsonl")]
    (error,) = dist_pools.get(1, "gloo").run(_preflight_error, raw)
    assert error == (
        f"checkpoint.resume: no such directory: {tmp_path / 'step_00000100'} (expected auto, never, or a step_* "
        "directory with a COMPLETE marker)"
    ), error
    (tmp_path / "step_00000100").mkdir()
    (error,) = dist_pools.get(1, "gloo").run(_preflight_error, raw)
    assert (
        error.startswith("checkpoint.resume: ") and "step_00000100 is not a complete checkpoint" in error
    ), error
