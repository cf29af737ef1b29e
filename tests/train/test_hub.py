"""Model sources by Hugging Face Hub id (`veomni.train.hub`), resolved offline from a cache laid out as
huggingface_hub writes it; the end-to-end run by id is in test_first_contact."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest

from veomni.train.hub import fetch_hub_sources, hub_id
from veomni.train.preflight import PreflightError
from veomni.train.recipe import load_recipe


def test_hub_ids_read_org_name_and_an_optional_revision(tmp_path, monkeypatch):
    assert hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert hub_id("Qwen/Qwen3-8B@a1b2c3") == ("Qwen/Qwen3-8B", "a1b2c3")
    assert hub_id("meta-llama/Llama-3.1-8B-Instruct@refs/pr/1") == (
        "meta-llama/Llama-3.1-8B-Instruct",
        "refs/pr/1",
    )
    for not_an_id in (
        "/abs/weights",
        "./weights",
        "weights",
        "a/b/c",
        "~/models/x",
        None,
        {"model_type": "qwen3"},
    ):
        assert hub_id(not_an_id) is None, not_an_id
    # A relative path that exists is the user's directory, even when it reads like an id.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_id("org/name") is None


def _snapshot(cache: Path, repo_id: str, commit: str, refs: list[str], files: dict[str, str]) -> Path:
    """One snapshot of ``repo_id`` in the Hub cache layout: snapshots/<commit>/ and refs/<ref> holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    # huggingface_hub reads both at call time (the environment variables only when it is imported).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_config_and_tokenizer_ids_resolve_to_their_cached_snapshots(offline_cache):
    main = _snapshot(offline_cache, "veomni-test/tiny", "a" * 40, ["main"], {"config.json": "{}"})
    v1 = _snapshot(offline_cache, "veomni-test/tiny", "b" * 40, ["v1"], {"tokenizer.json": "{}"})
    recipe = load_recipe(
        "quickstart", ["--model.config=veomni-test/tiny", "--model.tokenizer=veomni-test/tiny@v1"]
    )
    fetched = fetch_hub_sources(recipe)
    assert (fetched.model.config, fetched.model.tokenizer) == (str(main), str(v1))
    assert fetched.model.weights is None
    assert recipe.model.config == "veomni-test/tiny"  # the recipe as written is left alone
    # No id anywhere: the same recipe back, nothing looked up.
    local = load_recipe("quickstart")
    assert fetch_hub_sources(local) is local


def test_an_id_neither_cached_nor_reachable_is_one_line_naming_the_field(offline_cache):
    recipe = load_recipe("quickstart", ["--model.tokenizer=veomni-test/never-downloaded"])
    with pytest.raises(PreflightError) as caught:
        fetch_hub_sources(recipe)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "model.tokenizer: 'veomni-test/never-downloaded' is not a local path and reads as a Hugging Face Hub id, "
        "but it is not in the local cache and the Hub cannot be reached"
    )
    assert "hf download veomni-test/never-downloaded" in message
