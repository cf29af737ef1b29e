"""Checks that need no model: run before the (possibly minutes-long) model build, so a bad recipe fails at once.

Each raises `PreflightError` naming what was expected and what was found.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import attrs
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from veomni.core.freeze import freeze_modules
from veomni.core.sp.attention import kv_repeats_for_sp
from veomni.train.checkpoint import check_complete
from veomni.train.recipe import Recipe, RecipeError

log = logging.getLogger("veomni.train")


class PreflightError(ValueError):
    """A recipe, its data or its model config cannot make a sensible run."""


def check_warmup(warmup_steps: int, total_steps: int) -> None:
    """The warmup must fit in the run (a longer one never reaches the peak learning rate)."""
    if warmup_steps > total_steps:
        raise PreflightError(
            f"optim.warmup_steps={warmup_steps} is longer than the run ({total_steps} steps): the learning rate "
            "would never reach optim.lr; lower the warmup or train longer"
        )


def check_grad_accum(recipe: Recipe, dp: int) -> None:
    """The step budget splits into whole micro-batches on ``dp`` data-parallel ranks (`Recipe.grad_accum`): known
    from the world size, so checked before the data pipeline indexes the files."""
    try:
        recipe.grad_accum(dp)
    except RecipeError as err:
        raise PreflightError(str(err)) from None


def check_resume_path(resume: str) -> None:
    """An explicit ``checkpoint.resume`` path is a complete checkpoint (``auto`` and ``never`` name none)."""
    if resume in ("auto", "never"):
        return
    try:
        check_complete(resume)
    except FileNotFoundError as err:
        raise PreflightError(f"checkpoint.resume: {err}") from None


def check_sp_heads(config: PretrainedConfig, sp: int) -> None:
    """The language model's head counts are a valid grouped-query layout and, when Ulysses SP splits them over
    ``sp > 1`` ranks, allow that split."""
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        # transformers accepts such a config; the first attention call of the built model would fail.
        raise PreflightError(
            f"the model config ({type(config).__name__}): num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads} (each KV head serves a whole group of query heads)"
        )
    if sp == 1:
        return
    try:
        kv_repeats_for_sp(heads, kv_heads, sp)
    except ValueError as err:
        raise PreflightError(
            f"parallel.sp={sp} does not fit the model ({type(config).__name__}): {err}"
        ) from None


def check_parallel_fit(
    probe: nn.Module, fast_paths: Collection[str], *, backend: str, sp: int, ep: int
) -> None:
    """The model supports the recipe's SP and EP degrees: what the model build would refuse, found on the meta probe
    before the data is indexed (which can take minutes).

    Args:
        probe: a meta instance of the model class the run builds.
        fast_paths: the fast paths the registry lists for that class (``"sp"`` for Ulysses attention).
        backend: ``model.backend``; ``hf`` trains transformers' own class, which has neither SP nor EP.
        sp, ep: the run's ``parallel.sp`` and ``parallel.ep``.
    """
    name = type(probe).__name__
    if backend == "hf" and (sp > 1 or ep > 1):
        raise PreflightError(
            f"model.backend=hf trains transformers' own {name} with FSDP2 only (no Ulysses SP, no expert "
            f"parallelism), but parallel.sp={sp}, parallel.ep={ep}; set both to 1 or use model.backend=veomni"
        )
    if sp > 1 and "sp" not in fast_paths:
        raise PreflightError(
            f"parallel.sp={sp}: {name} does not support Ulysses sequence parallelism (its fast paths: "
            f"{sorted(fast_paths)}); set parallel.sp=1"
        )
    if ep == 1:
        return
    getter = getattr(probe, "get_parallel_plan", None)
    plan = getter() if getter is not None else None
    experts = {} if plan is None else {n: p.shape[0] for n, p in probe.named_parameters() if plan.matches(n)}
    if not experts:
        raise PreflightError(
            f"parallel.ep={ep}: {name} has no experts to split (not a MoE model); set parallel.ep=1"
        )
    uneven = sorted({int(count) for count in experts.values() if count % ep})
    if uneven:
        raise PreflightError(
            f"parallel.ep={ep} does not divide the {uneven[0]} experts of {name} (each EP rank holds experts / ep "
            f"of every MoE layer); choose an ep that divides {uneven[0]}"
        )


def check_vocab(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, tokenizer_path: str) -> None:
    """Every token id the tokenizer can produce must have an embedding row."""
    text = config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    if vocab is None:
        return
    needed = len(tokenizer)
    if needed > int(vocab):
        raise PreflightError(
            f"the tokenizer at {tokenizer_path} has {needed} tokens (ids up to {needed - 1}) but the model's "
            f"vocab_size is {vocab}: ids >= {vocab} would index past the embedding; use a config with "
            f"vocab_size >= {needed} or the model's own tokenizer"
        )


def check_trainable(probe: nn.Module, freeze: Sequence[str], lr_multipliers: Mapping[str, float]) -> None:
    """``model.freeze`` and ``optim.lr_multipliers`` name modules of the model and leave something to train.

    Args:
        probe: a meta instance of the model (its ``requires_grad`` flags are set as the run will set them).
    """
    from veomni.train.optim import param_groups, unmatched_multipliers

    try:
        freeze_modules(probe, freeze, where="model.freeze")
        param_groups(probe, 0.0, 1.0, lr_multipliers)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    if moot := unmatched_multipliers(probe, lr_multipliers)[1]:
        log.info("optim.lr_multipliers: %s only match frozen parameters (model.freeze): no effect", moot)


def check_ops_backend(recipe: Recipe) -> None:
    """``model.backend=hf`` trains the upstream model's own code, which binds no veomni kernel: an ``ops`` choice
    would be silently ignored, so one set there is an error (``compile: auto``, the default, is not a choice)."""
    chosen = {
        k: v for k, v in attrs.asdict(recipe.ops).items() if v is not None and (k, v) != ("compile", "auto")
    }
    if recipe.model.backend == "hf" and chosen:
        raise PreflightError(
            f"model.backend=hf trains the upstream model's own code without veomni kernels, but ops sets {chosen}; "
            "remove them or use model.backend=veomni"
        )


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def check_model_sources(recipe: Recipe) -> None:
    """``model.weights`` / ``model.config`` / ``model.tokenizer`` name what exists (after Hub ids were fetched),
    and a weights directory holds safetensors: PyTorch pickle weights are refused with the conversion to run.
    Refused rather than read with ``torch.load(weights_only=True)``: the loader reads each rank's own region of each
    tensor from safetensors (``safe_open(...).get_slice``), while a pickle file can only be read whole, into every
    rank's host memory at once (16 GB per rank for an 8B model); converting once costs one load."""
    model = recipe.model
    sources = {"weights": model.weights, "tokenizer": model.tokenizer}
    if isinstance(model.config, str):
        sources["config"] = model.config
    for field, value in sources.items():
        if value is not None and not Path(value).exists():
            raise PreflightError(
                f"model.{field}: no such file or directory: {value} (nor a Hugging Face Hub id: those read "
                "org/name[@revision])"
            )
    if model.tokenizer is not None:
        check_tokenizer_dir(Path(model.tokenizer))
    weights = Path(model.weights) if model.weights is not None else None
    if weights is not None and model.config is None:
        # The config is read from the weights (a file would be parsed as JSON; a directory needs config.json).
        if not weights.is_dir():
            raise PreflightError(
                f"model.weights: {weights} is a file, and with model.config null the model config is read from the "
                f"weights: give the checkpoint directory ({weights.parent}, if it holds config.json), or set "
                "model.config"
            )
        if not (weights / "config.json").is_file():
            raise PreflightError(
                f"model.weights: {weights} holds no config.json to read the model config from; set model.config "
                "(a config.json, its directory, or an inline mapping with model_type)"
            )
    if weights is None or not weights.is_dir():
        return
    names = sorted(p.name for p in weights.iterdir())
    if any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise PreflightError(
            f"model.weights: {weights} holds PyTorch pickle weights {pickles[:4]} but no safetensors (read whole "
            "into every rank's memory, so not read here); convert them once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out) (or the model's own Auto class) writes "
            "model.safetensors"
        )
    raise PreflightError(f"model.weights: {weights} holds no *.safetensors weights; it holds {names[:20]}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_dir(path: Path, field: str = "model.tokenizer") -> None:
    """``field`` names a directory that holds a tokenizer (transformers' loader, given one without, may build a
    stand-in from the config or fail deep in its conversion code)."""
    if path.is_file():
        raise PreflightError(
            f"{field}: {path} is a file; expected the directory that holds the tokenizer files ({path.parent})"
        )
    names = sorted(p.name for p in path.iterdir())
    if not any(n in TOKENIZER_FILES or n.endswith(".tiktoken") for n in names):
        raise PreflightError(
            f"{field}: {path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}, *.tiktoken); "
            f"it holds {names[:12]}"
        )


def check_run_dir(path: str) -> None:
    """``checkpoint.dir`` can be created and written to (found before the build, not at the first write after
    it). Every rank checks: on several nodes each must reach the shared directory."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PreflightError(f"checkpoint.dir: cannot create {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PreflightError(f"checkpoint.dir: {path} is not writable by this user")


def check_log_sinks(recipe: Recipe) -> None:
    """A configured TensorBoard or wandb sink is importable (found before the build, not after it)."""
    wanted = {"tensorboard": recipe.log.tensorboard_dir, "wandb": recipe.log.wandb_project}
    for extra, setting in wanted.items():
        if setting and importlib.util.find_spec(extra) is None:
            field = "log.tensorboard_dir" if extra == "tensorboard" else "log.wandb_project"
            raise PreflightError(
                f"{field} is set but {extra} is not installed: pip install 'veomni-train[{extra}]' (in a "
                f"checkout of this repository: uv sync --all-packages --extra {extra})"
            )
