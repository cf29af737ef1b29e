"""Recipes: strict loading, typed overrides, did-you-mean errors, dump -> load round trips, the token contract."""

from __future__ import annotations

import json
import os
import string
import types
import typing
from pathlib import Path

import attrs
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.core import ParallelDims
from veomni.kernels import op_fields
from veomni.train.recipe import (
    ASSETS_DIR,
    OpsSection,
    Recipe,
    RecipeError,
    builtin_recipes,
    dump_recipe,
    load_recipe,
    recipe_fields,
    recipe_from_dict,
    recipe_help,
    recipe_to_dict,
    save_recipe,
)
from veomni.train.recipe.parse import convert, field_type, iter_fields, parse_cli_value

LEAVES = dict(iter_fields(Recipe))


def minimal() -> dict:
    return {
        "model": {"config": {"model_type": "qwen3"}, "weights": None, "tokenizer": "/tok"},
        "data": {"train_files": ["/data/train.jsonl"]},
        "train": {"tokens_per_step": 4096, "tokens_per_micro_batch": 2048, "steps": 10},
    }


def write(tmp_path: Path, raw: dict, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


# --- strategies -------------------------------------------------------------------------------------------------

_names = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=10)
_paths = _names.map(lambda s: f"/data/{s}")


def _value(tp: typing.Any) -> st.SearchStrategy:
    """A value of a leaf type that passes the per-field validators (cross-field rules are handled by `recipes`)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[st.none() if a is type(None) else _value(a) for a in args])
    if origin is tuple:
        if args[-1] is Ellipsis:
            return st.lists(_value(args[0]), min_size=1, max_size=3).map(tuple)
        return st.tuples(*[_value(a) for a in args])
    return {
        bool: st.booleans(),
        int: st.integers(1, 10_000),
        float: st.floats(1e-6, 0.99, allow_nan=False),
        str: _paths,
        dict: st.fixed_dictionaries(
            {"model_type": st.sampled_from(["qwen3", "llama"])},
            optional={
                # Real keys of both config classes (unknown keys are refused at load); the string values
                # look like YAML scalars of other types and must survive dump -> load as strings.
                "hidden_size": st.integers(1, 4096),
                "rope_scaling": st.none(),
                "tie_word_embeddings": st.booleans(),
                "hidden_act": st.sampled_from(["1e4", "true", "null", "1.5", "x: y"]),
                "initializer_range": st.floats(1e-9, 1e9),
            },
        ),
    }[tp]


# Fields whose values are checked beyond their type: drawn from what the check accepts.
_module_globs = st.from_regex(r"[a-z_]{1,8}(\.([a-z_]{1,8}|\*|[0-9]{1,2})){0,3}", fullmatch=True)
FIELD_VALUES = {
    "data.format": st.none(),  # drawn with data.kind in `recipes`
    "data.columns": st.just({}),
    "data.dataset": st.none(),
    "data.sources": st.just(()),  # tests/train/test_mixtures.py covers mixtures  # the train_files above are the data; tests/train/test_hf_datasets.py covers it
    "optim.lr_multipliers": st.dictionaries(_module_globs, st.floats(0.0, 10.0), max_size=3),
    "model.freeze": st.lists(_module_globs, max_size=3).map(tuple),
    "model.config_overrides": st.fixed_dictionaries(
        {}, optional={"rms_norm_eps": st.floats(1e-9, 1e-3), "attention_dropout": st.just(0.0)}
    ),
}


# Data fields only data.kind=multimodal reads (None for the other kinds).
MEDIA_FIELDS = (
    "media_root",
    "patches_per_micro_batch",
    "video_fps",
    "video_max_frames",
    "video_frame_pixels",
)


@st.composite
def recipes(draw: st.DrawFn) -> dict:
    raw: dict = {}
    for key, _ in iter_fields(Recipe):
        section, leaf = key.split(".")
        strategy = FIELD_VALUES[key] if key in FIELD_VALUES else _value(field_type(Recipe, key))
        raw.setdefault(section, {})[leaf] = draw(strategy)
    raw["model"]["weights"] = draw(_paths)  # config/tokenizer may then be anything, null included
    # model.task=dit couples nearly every section (tests/train/test_dit_train.py covers its recipes).
    raw["model"]["task"] = draw(st.sampled_from(["text", "vlm"]))
    raw["data"]["kind"] = draw(st.sampled_from(["text", "conversation", "multimodal"]))
    raw["train"]["samples_per_step"] = raw["train"]["samples_per_micro_batch"] = None
    raw["dit"] = {}
    raw["dpo"] = {}  # model.task=dpo only (a dpo section set under another task is an error: test_dpo_train)
    # LoRA keys only with lora.enabled (a disabled section with keys set is an error, tested in test_lora_train).
    raw["lora"] = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries({
                "enabled": st.just(True), "rank": st.integers(1, 64), "alpha": st.floats(0.5, 64.0),
                "dropout": st.sampled_from([0.0, 0.05]), "use_rslora": st.booleans(),
                "targets": st.lists(st.sampled_from(["attention", "mlp", "q_proj"]), max_size=2, unique=True),
                "init": st.sampled_from(["default", "gaussian"]), "export": st.sampled_from(["both", "merged"]),
            }),
        )
    )  # fmt: skip
    if isinstance(raw["model"]["config"], dict):
        raw["model"]["config_overrides"] = {}  # an inline config takes its values directly
    micro = draw(st.integers(2, 4096))
    raw["train"]["tokens_per_micro_batch"] = micro
    raw["train"]["tokens_per_step"] = micro * draw(st.integers(1, 16))
    raw["data"]["max_seq_len"] = draw(st.integers(2, micro))
    raw["data"]["num_workers"] = draw(st.integers(0, 4))
    # fp16 compute trains over fp32 parameters only (loss scaling needs fp32 gradients).
    param_dtypes = ["float32"] if raw["model"]["dtype"] == "float16" else ["float32", raw["model"]["dtype"]]
    raw["model"]["param_dtype"] = draw(st.sampled_from(param_dtypes))
    if not raw["parallel"]["activation_checkpointing"]:
        raw["parallel"]["ac_keep_attention"] = False  # it chooses what checkpointing keeps
    if (raw["parallel"]["sp"] or 1) < 2:
        raw["parallel"]["async_ulysses"] = False  # it overlaps the Ulysses exchange
    kept, other = draw(st.sampled_from([("steps", "epochs"), ("epochs", "steps")]))
    raw["train"][kept], raw["train"][other] = draw(st.integers(1, 10_000)), None
    if raw["train"]["eval_interval"] is None:
        raw["data"]["eval_files"] = []
    if raw["data"]["kind"] != "multimodal":
        raw["data"]["use_audio_in_video"] = False  # videos (and their audio tracks) are multimodal data
        for name in MEDIA_FIELDS:
            raw["data"][name] = None  # read by the multimodal pipeline only
    # A chat template is a built-in name or an existing file, for conversations only.
    raw["data"]["chat_template"] = (
        None if raw["data"]["kind"] == "text" else draw(st.sampled_from([None, "chatml", "qwen3"]))
    )
    # A format preset converts rows for the kinds it names; data.columns renames what it reads.
    from veomni.train.data.presets import PRESETS

    presets = [name for name, preset in PRESETS.items() if raw["data"]["kind"] in preset.kinds]
    raw["data"]["format"] = draw(st.sampled_from([None, *presets]))
    if raw["data"]["format"] is not None:
        names = PRESETS[raw["data"]["format"]].names
        raw["data"]["columns"] = draw(
            st.dictionaries(st.sampled_from(names), st.sampled_from(["a", "1e4"]), max_size=2)
        )
    if raw["data"]["format"] == "pretokenized":
        raw["data"]["chat_template"] = None  # token rows are not rendered
    first = draw(st.integers(1, 50))
    raw["log"]["profile_steps"] = draw(st.sampled_from([None, [first, first + draw(st.integers(0, 5))]]))
    if raw["data"]["video_frame_pixels"] is not None:
        raw["data"]["video_frame_pixels"] = sorted(raw["data"]["video_frame_pixels"])  # [min, max]
    raw["data"] = {k: list(v) if isinstance(v, tuple) else v for k, v in raw["data"].items()}
    raw["optim"]["betas"] = list(raw["optim"]["betas"])
    return raw


def cli_text(value: typing.Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(cli_text(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


# --- tests ------------------------------------------------------------------------------------------------------


@settings(max_examples=60)
@given(raw=recipes())
def test_dump_load_round_trip(tmp_path_factory, raw):
    recipe = recipe_from_dict(raw)
    path = tmp_path_factory.mktemp("rt") / "resolved.yaml"
    save_recipe(recipe, path)
    assert load_recipe(path) == recipe
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    assert yaml.safe_load(dump_recipe(recipe)) == recipe_to_dict(recipe)


# Fields whose values constrain each other (cross-field rules of the recipe): overriding one of them alone could
# make a valid recipe invalid, so the override test sets every field of the drawn key's group to the target's.
COUPLED = [
    {"train.steps", "train.epochs"},
    {"train.tokens_per_step", "train.tokens_per_micro_batch", "data.max_seq_len"},
    {"data.eval_files", "train.eval_interval"},
    {"model.dtype", "model.param_dtype"},
    {"parallel.activation_checkpointing", "parallel.ac_keep_attention"},
    {"parallel.sp", "parallel.async_ulysses"},
    {"model.config", "model.config_overrides", "model.weights", "model.tokenizer"},
    {
        "data.kind",
        "data.use_audio_in_video",
        "data.chat_template",
        "data.format",  # a preset converts rows for some kinds, and renames only the columns it reads
        "data.columns",
        *(f"data.{name}" for name in MEDIA_FIELDS),
    },
]


def coupled_with(key: str) -> list[str]:
    """``key`` and the fields its value is checked against, in schema order."""
    group = next((g for g in COUPLED if key in g), {key})
    return [k for k in LEAVES if k in group]


def test_coupled_groups_name_real_fields():
    assert all(g <= set(LEAVES) for g in COUPLED)


@settings(max_examples=60)
@given(raw=recipes(), other=recipes(), data=st.data())
def test_overrides_parse_to_the_typed_value(tmp_path_factory, raw, other, data):
    target = recipe_from_dict(raw)
    key = data.draw(st.sampled_from(sorted(LEAVES)))
    keys = coupled_with(key)
    values = {k: getattr(getattr(target, k.split(".")[0]), k.split(".")[1]) for k in keys}
    path = save_recipe(recipe_from_dict(other), tmp_path_factory.mktemp("ov") / "r.yaml")
    joined = [f"--{k}={cli_text(v)}" for k, v in values.items()]
    split = [item for k, v in values.items() for item in (f"--{k}", cli_text(v))]
    for form in (joined, split):
        loaded = load_recipe(path, form)
        for k, v in values.items():
            assert getattr(getattr(loaded, k.split(".")[0]), k.split(".")[1]) == v, form
    for k, v in values.items():
        tp = field_type(Recipe, k)
        assert convert(parse_cli_value(cli_text(v), tp, k), tp, k) == v


def _typo(leaf: str, data: st.DataObject) -> str:
    i = data.draw(st.integers(0, len(leaf) - 1))
    kind = data.draw(st.sampled_from(["delete", "replace", "insert", "swap"]))
    char = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"))
    if kind == "delete" and len(leaf) > 1:
        return leaf[:i] + leaf[i + 1 :]
    if kind == "swap" and i + 1 < len(leaf):
        return leaf[:i] + leaf[i + 1] + leaf[i] + leaf[i + 2 :]
    if kind == "replace":
        return leaf[:i] + char + leaf[i + 1 :]
    return leaf[:i] + char + leaf[i:]


@settings(max_examples=80)
@given(data=st.data())
def test_typos_raise_with_did_you_mean(tmp_path_factory, data):
    key = data.draw(st.sampled_from(sorted(LEAVES)))
    section, leaf = key.split(".")
    typo = _typo(leaf, data)
    siblings = {k.split(".")[1] for k in LEAVES if k.startswith(section + ".")}
    if typo in siblings:
        return  # the edit produced another valid field
    raw = minimal()
    raw.setdefault(section, {})[typo] = 1
    path = write(tmp_path_factory.mktemp("typo"), raw)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert f"unknown key {section}.{typo}" in message
    assert "did you mean" in message or "known here" in message
    if len(leaf) >= 5:
        assert f"did you mean {key}?" in message
    with pytest.raises(RecipeError, match=f"unknown override --{section}.{typo}") as info:
        load_recipe(write(tmp_path_factory.mktemp("typo"), minimal()), [f"--{section}.{typo}=1"])
    if len(leaf) >= 5:
        assert f"did you mean --{key}?" in str(info.value)


def test_misplaced_field_suggests_its_section(tmp_path):
    raw = minimal()
    raw["train"]["lr"] = 0.1
    with pytest.raises(RecipeError, match=r"unknown key train.lr \(did you mean optim.lr\?\)"):
        load_recipe(write(tmp_path, raw))
    with pytest.raises(RecipeError, match=r"unknown override --train.lr \(did you mean --optim.lr\?\)"):
        load_recipe(write(tmp_path, minimal()), ["--train.lr=0.1"])
    raw = minimal()
    raw["optimizer"] = {}
    with pytest.raises(RecipeError, match=r"unknown key optimizer \(did you mean optim\?\)"):
        load_recipe(write(tmp_path, raw))


def test_every_problem_is_reported_at_once(tmp_path):
    raw = minimal()
    raw["optim"] = {"lr": "fast", "schedule": "cosin"}
    raw["data"]["shuffel"] = True
    del raw["train"]["tokens_per_step"]
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, raw))
    message = str(info.value)
    assert "optim.lr: expected float, found str 'fast'" in message
    assert (
        "optim.schedule: expected one of ['cosine', 'linear', 'constant'], found 'cosin' (did you mean 'cosine'?)"
        in message
    )
    assert "unknown key data.shuffel (did you mean data.shuffle?)" in message
    assert "train.tokens_per_step: required, missing" in message


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r["train"].update(epochs=2), "set exactly one of steps and epochs"),
        (lambda r: r["train"].update(steps=None), "set exactly one of steps and epochs"),
        (lambda r: r["train"].update(tokens_per_step=3000), "not a multiple of train.tokens_per_micro_batch"),
        (lambda r: r["data"].update(max_seq_len=4096), "a sample must fit in one micro-batch"),
        (lambda r: r["train"].update(eval_interval=5), "data.eval_files is empty"),
        (lambda r: r["data"].update(eval_files=["/e.jsonl"]), "the eval data would go unused"),
        (lambda r: r["model"].update(config=None), "give model.config"),
        (lambda r: r["model"].update(config={"hidden_size": 8}), "needs a model_type"),
        (lambda r: r["model"].update(tokenizer=None), "model.tokenizer: needed"),
        (
            lambda r: r["model"].update(dtype="float16", param_dtype="bfloat16"),
            "model.param_dtype: expected float32 or model.dtype (float16), found bfloat16",
        ),
        (
            lambda r: r["optim"].update(betas=[0.9]) if "optim" in r else r.update(optim={"betas": [0.9]}),
            "list of 2",
        ),
        (lambda r: r.update(optim={"min_lr_ratio": 1.5}), "min_lr_ratio: expected a value in"),
        # What torch's AdamW refuses (only once the model is built) and what would train on NaN, at load.
        (lambda r: r.update(optim={"eps": -1e-8}), "optim.eps: expected >= 0, found -1e-08"),
        (lambda r: r.update(optim={"weight_decay": -0.1}), "optim.weight_decay: expected >= 0, found -0.1"),
        (lambda r: r.update(optim={"lr": float("nan")}), "optim.lr: expected a finite value > 0, found nan"),
        (lambda r: r.update(optim={"lr": float("inf")}), "optim.lr: expected a finite value > 0, found inf"),
        (
            lambda r: r.update(optim={"max_grad_norm": float("nan")}),
            "optim.max_grad_norm: expected > 0 or None",
        ),
        (
            lambda r: r.update(optim={"moe_bias_update_speed": float("nan")}),
            "moe_bias_update_speed: expected >= 0",
        ),
        (lambda r: r.update(optim={"lr_multipliers": {"lm_head": float("nan")}}), "expected numbers >= 0"),
        (lambda r: r["data"].update(train_files="/one.jsonl"), "data.train_files: expected list"),
        (lambda r: r["train"].update(steps=True), "train.steps: expected int | null, found bool"),
        (lambda r: r.update(parallel={"sp": 0}), "parallel.sp: expected >= 1"),
        (
            lambda r: r.update(parallel={"ac_keep_attention": True}),
            "ac_keep_attention: true chooses what activation checkpointing keeps",
        ),
        (
            lambda r: r.update(
                parallel={"activation_checkpointing": True, "ac_keep_attention": True},
                ops={"attention": "eager"},
            ),
            "parallel.ac_keep_attention: true saves the attention kernel's output, but ops.attention 'eager'",
        ),
        (
            lambda r: r.update(
                parallel={"activation_checkpointing": True, "ac_keep_attention": True},
                ops={"attention": "flash_attn_4"},
            ),
            "ops.attention 'flash_attn_4' runs no kernel that checkpointing can keep; pick one of "
            r"\['flash_attn_2', 'flash_attn_3', 'sdpa', 'varlen'\]",
        ),
        (lambda r: r["train"].update(seed=-1), "train.seed: expected >= 0"),
        # Fields the text and conversation pipelines never read are refused, not ignored.
        (
            lambda r: r["data"].update(patches_per_micro_batch=4096),
            "data.patches_per_micro_batch: read for data.kind multimodal only, but data.kind is 'conversation'",
        ),
        (
            lambda r: r["data"].update(kind="text", media_root="/media"),
            "data.media_root: read for data.kind multimodal, dit only, but data.kind is 'text'",
        ),
        (lambda r: r["data"].update(video_fps=2.0), "data.video_fps: read for data.kind multimodal only"),
        (lambda r: r.update(model=[1]), "model: expected a mapping"),
    ],
)
def test_invalid_values_are_named(tmp_path, edit, message):
    raw = minimal()
    edit(raw)
    with pytest.raises(
        RecipeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")
    ):
        load_recipe(write(tmp_path, raw))


def test_yaml_float_quirk_and_typed_cli_values(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(minimal()) + "optim:\n  lr: 1e-4\n")  # YAML 1.1 reads 1e-4 as a string
    assert load_recipe(path).optim.lr == 1e-4
    r = load_recipe(
        path, ["--optim.betas=[0.8, 0.9]", "--data.train_files", "a.jsonl,b.jsonl", "--data.shuffle=no"]
    )
    assert r.optim.betas == (0.8, 0.9)
    assert r.data.train_files == (os.path.abspath("a.jsonl"), os.path.abspath("b.jsonl"))
    assert r.data.shuffle is False
    with pytest.raises(RecipeError, match="data.shuffle: expected true or false, found 'maybe'"):
        load_recipe(path, ["--data.shuffle=maybe"])
    with pytest.raises(RecipeError, match="has no value"):
        load_recipe(path, ["--optim.lr"])
    with pytest.raises(RecipeError, match="expected --section.field=value"):
        load_recipe(path, ["optim.lr=1"])


def test_inline_config_entries_can_be_overridden(tmp_path):
    path = write(tmp_path, minimal())
    r = load_recipe(
        path, ["--model.config.num_hidden_layers=2", "--model.config.rope_parameters.rope_theta=1e4"]
    )
    assert r.model.config == {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "rope_parameters": {"rope_theta": 1e4},
    }
    assert load_recipe(path).model.config == {"model_type": "qwen3"}
    r = load_recipe(path, ["--model.config={model_type: llama, hidden_size: 64}"])
    assert r.model.config == {"model_type": "llama", "hidden_size": 64}
    raw = minimal()
    raw["model"]["config"] = "/cfg"
    with pytest.raises(RecipeError, match="model.config is not an inline mapping here"):
        load_recipe(write(tmp_path, raw), ["--model.config.hidden_size=2"])


def test_an_entry_of_a_mapping_field_the_file_leaves_at_its_default_can_be_set(tmp_path):
    # config_overrides is {} by default: setting one entry needs no `config_overrides: {}` in the file, and the
    # recipe behaves the same before and after a dump (which writes the {}).
    override = ["--model.config_overrides.attention_dropout=0.1"]
    assert load_recipe("qwen3_0.6b", override).model.config_overrides == {"attention_dropout": 0.1}
    dumped = save_recipe(load_recipe("qwen3_0.6b"), tmp_path / "r.yaml")
    assert load_recipe(dumped, override) == load_recipe("qwen3_0.6b", override)


def test_a_module_glob_of_lr_multipliers_is_one_key_on_the_command_line():
    # `--optim.lr_multipliers.model.visual=0.1` sets the glob "model.visual", not {"model": {"visual": 0.1}}.
    recipe = load_recipe(
        "quickstart-vlm", ["--optim.lr_multipliers.model.visual=0.1", "--optim.lr_multipliers.x.*=2"]
    )
    assert recipe.optim.lr_multipliers == {"model.visual": 0.1, "x.*": 2}


def test_bare_on_and_off_in_yaml_are_the_choices_of_that_name(tmp_path):
    # YAML 1.1 reads a bare `off` as False; the docs write `ops.compile: off`.
    raw = minimal()
    for word, want in (("off", "off"), ("on", "on"), ("auto", "auto")):
        path = tmp_path / f"{word}.yaml"
        path.write_text(yaml.safe_dump(raw) + f"ops:\n  compile: {word}\n")
        assert load_recipe(path).ops.compile == want
    # The command line reads a choice as the file does: true/yes are 'on' and false/no are 'off' there too.
    base = write(tmp_path, raw, "base.yaml")
    for word, want in (("false", "off"), ("no", "off"), ("true", "on"), ("yes", "on")):
        path = tmp_path / f"{word}.yaml"
        path.write_text(yaml.safe_dump(raw) + f"ops:\n  compile: {word}\n")
        assert load_recipe(path).ops.compile == want
        assert load_recipe(base, [f"--ops.compile={word}"]).ops.compile == want
    # A choice without on/off words quotes what was typed, not a converted bool.
    with pytest.raises(RecipeError, match=r"model.backend: expected one of \['veomni', 'hf'\], found 'off'"):
        load_recipe(base, ["--model.backend=off"])
    text = yaml.safe_dump(raw).replace("data:\n", "data:\n  shuffle: off\n")  # a bool field keeps YAML's bool
    path.write_text(text)
    assert load_recipe(path).data.shuffle is False


def test_paths_resolve_against_cwd_and_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = minimal()
    raw["data"]["train_files"] = ["rel/train.jsonl", "builtin://quickstart/train.jsonl"]
    raw["checkpoint"] = {"dir": "~/runs/x", "resume": "never"}
    r = load_recipe(write(tmp_path, raw))
    assert r.data.train_files == (
        str(tmp_path / "rel/train.jsonl"),
        str(ASSETS_DIR / "quickstart/train.jsonl"),
    )
    assert r.checkpoint.dir == os.path.expanduser("~/runs/x")
    assert r.checkpoint.resume == "never"
    raw["model"]["tokenizer"] = "builtin://nothing/here"
    with pytest.raises(RecipeError, match="builtin://nothing/here: no such packaged asset"):
        load_recipe(write(tmp_path, raw))


def test_builtin_names_and_unknown_sources(tmp_path):
    assert "quickstart" in builtin_recipes()
    with pytest.raises(RecipeError, match=r"did you mean 'quickstart'\?"):
        load_recipe("quikstart")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    bad.write_text("- a list\n")
    with pytest.raises(RecipeError, match="expected a mapping of sections"):
        load_recipe(bad)


def test_help_lists_every_field_with_default_and_meaning():
    text = recipe_help()
    for key, field in LEAVES.items():
        assert f"--{key}  (" in text, key
        assert field.metadata["help"] in text, key
    assert "--optim.lr  (float; default 0.0003)" in text
    assert "--model.weights  (str | null; required)" in text
    assert "--optim.betas  (list of 2 float; default [0.9, 0.95])" in text
    assert recipe_fields() == list(LEAVES)


def test_ops_section_mirrors_ops_config():
    # One backend field per op, plus the compile switch (not an op).
    assert [f.name for f in attrs.fields(OpsSection)] == [*op_fields(), "compile"]
    ops = OpsSection(rms_norm="eager").to_ops_config()
    assert ops.rms_norm == "eager"
    with pytest.raises(ValueError, match="not a known backend"):
        OpsSection(rms_norm="eagre").to_ops_config()


def test_token_contract_and_parallel_dims(tmp_path):
    r = load_recipe(write(tmp_path, minimal()), ["--train.tokens_per_step=16384"])
    assert [r.grad_accum(dp) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(RecipeError, match="tokens_per_micro_batch \\* dp = 2048 \\* 3 = 6144"):
        r.grad_accum(3)
    assert r.parallel_dims(8) == ParallelDims(dp_shard=8)
    r = load_recipe(write(tmp_path, minimal()), ["--parallel.sp=2", "--parallel.dp_replicate=2"])
    assert r.parallel_dims(8) == ParallelDims(dp_replicate=2, dp_shard=2, sp=2)
    with pytest.raises(RecipeError, match="world size 6 is not divisible by dp_replicate\\*sp"):
        r.parallel_dims(6)


def test_quickstart_recipe_is_complete():
    r = load_recipe("quickstart")
    assert r.model.weights is None and r.model.config["model_type"] == "qwen3"
    assert all(Path(p).is_file() for p in r.data.train_files + r.data.eval_files)
    assert Path(r.model.tokenizer_path, "tokenizer.json").is_file()
    assert r.train.device == "cpu" and r.grad_accum(1) >= 1 and r.grad_accum(2) >= 1
    assert load_recipe("quickstart", ["--train.seed=3"]).train.seed == 3
