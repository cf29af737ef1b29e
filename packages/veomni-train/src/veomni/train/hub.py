"""Model sources by Hugging Face Hub id: ``model.weights: Qwen/Qwen3-8B`` (or ``Qwen/Qwen3-8B@<revision>``).

The recipe keeps the id as written (so the saved ``recipe.yaml`` names what was trained); `fetch_hub_sources`
swaps each id for the local snapshot directory `huggingface_hub.snapshot_download` returns, which caches
(``HF_HOME`` / ``HF_HUB_CACHE``) and honours ``HF_HUB_OFFLINE=1`` and ``HF_TOKEN``. Only the files training
reads are fetched: configs, safetensors, tokenizer and chat-template files, never duplicate ``.bin`` weights.
"""

from __future__ import annotations

import os
import re
from typing import Any

import attrs

from veomni.train.preflight import PreflightError
from veomni.train.recipe import Recipe

# ``org/name`` as the Hub spells repository ids, with an optional ``@revision``.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[\w])(?:@(?P<revision>[\w./-]+))?$")

CONFIG_FILES = ["*.json"]
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
WEIGHT_FILES = sorted({*TOKENIZER_FILES, "*.safetensors"})
PATTERNS = {"weights": WEIGHT_FILES, "config": CONFIG_FILES, "tokenizer": TOKENIZER_FILES}


def hub_id(value: Any) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``value`` reads as a Hub id and names no local path, else None."""
    if not isinstance(value, str) or os.path.exists(os.path.expanduser(value)):
        return None
    match = HUB_ID.match(value)
    return None if match is None else (match["repo"], match["revision"])


def fetch_hub_sources(recipe: Recipe, *, weights: bool = True) -> Recipe:
    """The recipe with each Hub id in ``model.weights`` / ``model.config`` / ``model.tokenizer`` replaced by the
    local snapshot directory (downloaded once, then read from the cache). Unchanged when none is an id.
    ``weights=False`` fetches the configs and tokenizer files of ``model.weights`` but not its safetensors
    (`veomni-data-preview` needs only the tokenizer).

    Raises:
        PreflightError: one line naming the field, the id and why it could not be fetched (offline and not
            cached, no such repository or revision, a gated repository without a token, a network error).
    """
    model = recipe.model
    changes = {}
    for field in ("weights", "config", "tokenizer"):
        found = hub_id(getattr(model, field))
        if found is not None:
            patterns = PATTERNS[field] if field != "weights" or weights else TOKENIZER_FILES
            changes[field] = _snapshot(f"model.{field}", getattr(model, field), *found, patterns)
    return recipe if not changes else attrs.evolve(recipe, model=attrs.evolve(model, **changes))


def _snapshot(field: str, value: str, repo_id: str, revision: str | None, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return str(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        why = (
            "it is not in the local cache and the Hub cannot be reached (offline: HF_HUB_OFFLINE is set, or no "
            "network); download it where there is a network (hf download " + repo_id + ") or give a local path"
        )
    except GatedRepoError:
        why = "the repository is gated: accept its terms on the Hub and set HF_TOKEN (or run hf auth login)"
    except RevisionNotFoundError:
        why = f"the repository has no revision {revision!r}"
    except RepositoryNotFoundError:
        why = "no such repository on the Hub (or it is private: set HF_TOKEN)"
    except Exception as err:  # network and HTTP errors come in many types; the message says which
        why = f"fetching it failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    raise PreflightError(f"{field}: {value!r} is not a local path and reads as a Hugging Face Hub id, but {why}")
