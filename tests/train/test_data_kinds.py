"""Data kinds by name (`veomni.train.data.kinds`): a user's own row encoder (`user_data_kind`, prompt/completion
rows) trains through the unchanged trainer, registered by name or named by import path, and every wrong name,
task or factory is an error that names the choices."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import write_jsonl
from test_loop import DENSE, tiny_recipe

from veomni.train.data import DataError, RowRef, build_encoder, register_data_kind
from veomni.train.data.build import check_task_and_kind, encoder_for
from veomni.train.data.encode import load_tokenizer
from veomni.train.data.kinds import data_kind, data_kind_names
from veomni.train.recipe import ASSETS_DIR, DataSection, RecipeError, recipe_from_dict

TOKENIZER = str(ASSETS_DIR / "quickstart" / "tokenizer")
REF = RowRef("rows.jsonl", 0, 1)


def rows(n: int) -> list[dict]:
    return [
        {"prompt": f"Question {k}: what is {k} plus {k}?", "completion": f" It is {2 * k}."} for k in range(n)
    ]


def kind_recipe(tmp_path, kind: str) -> dict:
    raw = tiny_recipe(str(tmp_path / "run"), DENSE, steps=1)
    raw["model"]["tokenizer"] = TOKENIZER
    raw["data"].update(
        {"kind": kind, "train_files": [str(write_jsonl(tmp_path / "rows.jsonl", rows(64)))], "num_workers": 0}
    )
    raw["data"]["chat_template"] = None
    return raw


def _first_step(ctx, raw: dict) -> dict:
    import user_data_kind  # noqa: F401 - registers "prompt_completion" in this rank's process, as a user's import would

    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    step = next(iter(run.train_data))
    labels = [b["labels"][b["labels"] != -100].tolist() for b in step.micro_batches]
    stats = train_step(run, step)
    return {
        "loss": stats["loss"],
        "trained_text": [run.tokenizer.decode(ids) for ids in labels],
    }


@pytest.mark.parametrize("kind", ["prompt_completion", "user_data_kind:PromptCompletionEncoder"])
def test_a_user_data_kind_trains_a_step_through_the_trainer(dist_pools, tmp_path, kind):
    result = dist_pools.get(1, "gloo").run(_first_step, kind_recipe(tmp_path, kind))[0]
    assert np.isfinite(result["loss"]) and result["loss"] > 0
    # Only the completions and their end tokens were trained, never a prompt.
    trained = "".join(result["trained_text"])
    assert "It is" in trained and "Question" not in trained and "plus" not in trained


def test_the_user_encoder_trains_the_completion_only():
    import user_data_kind

    tokenizer = load_tokenizer(TOKENIZER)
    section = DataSection(train_files=("rows.jsonl",), kind="prompt_completion")
    encoder = encoder_for(section, tokenizer)
    assert isinstance(encoder, user_data_kind.PromptCompletionEncoder)
    ids, trained = encoder({"prompt": "Say hi.", "completion": " Hi."}, REF)
    assert tokenizer.decode(ids[trained]) == " Hi." + tokenizer.eos_token
    assert not trained[: len(tokenizer("Say hi.", add_special_tokens=False)["input_ids"])].any()
    with pytest.raises(DataError, match=r"rows.jsonl line 1: 'completion' must be a non-empty string"):
        encoder({"prompt": "Say hi."}, REF)


def test_kinds_are_checked_against_the_task_and_named_in_errors(tmp_path):
    import user_data_kind  # noqa: F401

    assert {"text", "conversation", "multimodal", "dit", "dit_latents", "prompt_completion"} <= set(
        data_kind_names()
    )
    with pytest.raises(
        RecipeError, match=r"data.kind: expected one of \[.*'prompt_completion'.*\] or a data kind "
    ):
        recipe_from_dict(kind_recipe(tmp_path, "prompt_complection"))
    with pytest.raises(RecipeError, match="data.kind='user_data_kind:Nothing': user_data_kind has no class"):
        recipe_from_dict(kind_recipe(tmp_path, "user_data_kind:Nothing"))
    with pytest.raises(RecipeError, match="cannot import 'no_such_package.data': No module named"):
        recipe_from_dict(kind_recipe(tmp_path, "no_such_package.data:Encoder"))
    # A kind trains with the tasks that list it or that it names: prompt_completion names text, not vlm.
    raw = kind_recipe(tmp_path, "prompt_completion")
    check_task_and_kind(recipe_from_dict(raw))
    raw["model"]["task"] = "vlm"
    with pytest.raises(
        DataError, match=r"model.task='vlm' trains on data.kind in \['multimodal'\].*which trains "
    ):
        check_task_and_kind(recipe_from_dict(raw))
    # The text task does not train on multimodal rows (no kind names it).
    raw = kind_recipe(tmp_path, "multimodal")
    with pytest.raises(
        DataError, match=r"model.task='text' trains on data.kind in \['text', 'conversation'\]"
    ):
        check_task_and_kind(recipe_from_dict(raw))


def test_registering_is_checked():
    with pytest.raises(ValueError, match=r"data kind 'text' is already registered"):
        register_data_kind("text")(lambda data, tokenizer: None)
    with pytest.raises(ValueError, match="':' marks an import path"):
        register_data_kind("pkg.mod:Kind")
    register_data_kind("not_an_encoder")(lambda data, tokenizer: object())
    section = DataSection(train_files=("rows.jsonl",), kind="not_an_encoder")
    with pytest.raises(DataError, match=r"data.kind='not_an_encoder': .* returned object, not an encoder"):
        encoder_for(section, load_tokenizer(TOKENIZER))
    assert data_kind("text").factory is not None and data_kind("dit").factory is None
    with pytest.raises(DataError, match=r"data.kind='dit' rows are read by their task's own pipeline"):
        encoder_for(DataSection(train_files=("rows.jsonl",), kind="dit"), load_tokenizer(TOKENIZER))
    # The built-in text kinds are the same encoders as before.
    text = DataSection(train_files=("rows.jsonl",), kind="text")
    assert type(encoder_for(text, load_tokenizer(TOKENIZER))) is type(
        build_encoder(load_tokenizer(TOKENIZER), "text")
    )
