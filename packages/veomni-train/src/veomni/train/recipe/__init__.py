"""Training recipes: a strict attrs schema loaded from YAML with ``--section.field=value`` overrides.

A recipe has eleven sections (model, data, parallel, ops, optim, train, checkpoint, log, dit, lora, dpo; their
classes are in `veomni.train.recipe.sections`, ``run_sections``, ``lora_section`` and ``dpo_section``); every field is typed and documented in its metadata, which `recipe_help` turns
into the ``--help`` text. Loading is strict: an unknown key
(in the YAML or an override) is an error with a did-you-mean, a value of the wrong type is an error naming the
field, the expected type and what was found, and every problem of a file is reported at once.

Paths: a relative path is taken relative to the current directory, and ``builtin://X`` names the file X inside the
package's ``assets`` directory. Both are made absolute when the recipe is loaded, so a dumped recipe reloads to
an equal one from anywhere (``load_recipe(path_of(dump_recipe(r))) == r``).

The batch contract is in tokens: ``train.tokens_per_step`` tokens per optimizer step over all data-parallel ranks,
``train.tokens_per_micro_batch`` tokens per packed micro-batch on each data-parallel rank (before the SP split; SP
peers share one micro-batch). Gradient accumulation is derived (`Recipe.grad_accum`):

    grad_accum = tokens_per_step / (tokens_per_micro_batch * dp),   dp = dp_replicate * dp_shard

and must be a whole number. Both sizes are budgets: packing fills each micro-batch up to its budget with whole
samples, so a step holds at most ``tokens_per_step`` tokens.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from veomni.core import ParallelDims
from veomni.kernels import KERNELS
from veomni.kernels.attention.features import CHECKPOINT_KEEPABLE
from veomni.train.recipe import parse as recipe_parse
from veomni.train.recipe.data_section import DataSection
from veomni.train.recipe.dpo_section import DpoSection
from veomni.train.recipe.lora_section import LoraSection
from veomni.train.recipe.parse import RecipeError
from veomni.train.recipe.run_sections import (
    CheckpointSection,
    DitSection,
    LogSection,
    OptimSection,
    TrainSection,
)
from veomni.train.recipe.sections import (
    ModelSection,
    OpsSection,
    ParallelSection,
    _field,
    _required,
)

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
BUILTIN_PREFIX = "builtin://"


DIT_KINDS = ("dit", "dit_latents")
# The data fields the clip pipeline (veomni.train.tasks.dit_setup, veomni-dit-embed) reads; the rest belong to the token
# pipeline. eval_files has a check of its own.
DIT_DATA_FIELDS = ("train_files", "eval_files", "file_format", "kind", "media_root", "shuffle", "num_workers")


def check_task_sections(recipe: Recipe) -> None:
    """The dit task and the dit data kinds, sample contract and dit section go together (nothing of one is
    silently ignored by the other)."""
    dit_task = recipe.model.task == "dit"
    if dit_task != (recipe.data.kind in DIT_KINDS):
        raise RecipeError(
            f"model.task={recipe.model.task!r} with data.kind={recipe.data.kind!r}: model.task=dit trains on "
            f"data.kind in {list(DIT_KINDS)} and those kinds need model.task=dit"
        )
    samples = recipe.train.samples_per_step is not None
    if dit_task != samples:
        raise RecipeError(
            "train: model.task=dit counts its batches in samples (train.samples_per_step, "
            "train.samples_per_micro_batch), the other tasks in tokens (train.tokens_per_step, "
            f"train.tokens_per_micro_batch); model.task={recipe.model.task!r} has the {'sample' if samples else 'token'} "
            "contract"
        )
    if not dit_task:
        changed = [
            k
            for k, v in recipe_parse.to_plain(recipe.dit).items()
            if v != recipe_parse.to_plain(DitSection())[k]
        ]
        if changed:
            raise RecipeError(
                f"dit: {['dit.' + k for k in changed]} set, but model.task={recipe.model.task!r} (not dit)"
            )
        return
    data = recipe_parse.to_plain(recipe.data)
    defaults = recipe_parse.to_plain(DataSection(train_files=("x",)))
    unread = sorted(f"data.{k}" for k, v in data.items() if k not in DIT_DATA_FIELDS and v != defaults[k])
    if unread:
        raise RecipeError(
            f"{unread} set, but model.task=dit does not read them (its data fields: "
            f"{['data.' + k for k in DIT_DATA_FIELDS]}); remove them"
        )
    if recipe.dit.condition is None:
        raise RecipeError("dit.condition: required for model.task=dit (the Wan pipeline directory), missing")
    if recipe.data.eval_files:
        raise RecipeError(
            f"data.eval_files: model.task=dit has no evaluation pass yet; found {list(recipe.data.eval_files)}"
        )


@attrs.frozen(kw_only=True)
class Recipe:
    """A complete, validated training recipe. Build it with `load_recipe` (or `recipe_from_dict`)."""

    model: ModelSection = _required("the model and tokenizer")
    data: DataSection = _required("training and evaluation data")
    parallel: ParallelSection = _field(ParallelSection, "parallel degrees", factory=True)
    ops: OpsSection = _field(OpsSection, "kernel backends", factory=True)
    optim: OptimSection = _field(OptimSection, "optimizer and learning-rate schedule", factory=True)
    train: TrainSection = _required("batch contract, length and cadence")
    checkpoint: CheckpointSection = _field(CheckpointSection, "checkpoints and exports", factory=True)
    log: LogSection = _field(LogSection, "metric sinks", factory=True)
    dit: DitSection = _field(
        DitSection, "diffusion transformers (model.task=dit): condition models, noising", factory=True
    )
    lora: LoraSection = _field(LoraSection, "LoRA adapters on a frozen base (parameter-efficient fine-tuning)", factory=True)
    dpo: DpoSection = _field(
        DpoSection, "preference optimisation (model.task=dpo): the pair loss and its coefficients", factory=True
    )

    def __attrs_post_init__(self) -> None:
        check_task_sections(self)
        if self.model.task != "dpo" and self.dpo != DpoSection():
            changed = [k for k, v in attrs.asdict(self.dpo).items() if v != attrs.asdict(DpoSection())[k]]
            raise RecipeError(f"dpo: {['dpo.' + k for k in changed]} set, but model.task={self.model.task!r} (not dpo)")
        if self.lora.enabled and self.model.task == "dit":
            raise RecipeError(
                "lora.enabled with model.task=dit: LoRA on diffusion transformers (diffusers' adapter format) is not "
                "built yet; train the DiT in full (lora.enabled: false)"
            )
        if (
            self.train.tokens_per_micro_batch is not None
            and self.data.max_seq_len > self.train.tokens_per_micro_batch
        ):
            raise RecipeError(
                f"data.max_seq_len={self.data.max_seq_len} exceeds train.tokens_per_micro_batch="
                f"{self.train.tokens_per_micro_batch}: a sample must fit in one micro-batch"
            )
        keepable = sorted(CHECKPOINT_KEEPABLE)
        attention = self.ops.attention
        # Registered backends only: an unknown name is OpsConfig's error (it lists the backends).
        unkept = attention in KERNELS.backends("attention") and attention not in keepable
        if self.parallel.ac_keep_attention and unkept and self.model.backend != "hf":
            # No kernel output the checkpoint could keep (eager: matmuls and a softmax; flex, flash_attn_4: kernels
            # torch does not dispatch as one op): every block would be recomputed whole while the recipe says not.
            raise RecipeError(
                f"parallel.ac_keep_attention: true saves the attention kernel's output, but ops.attention "
                f"{attention!r} runs no kernel that checkpointing can keep; pick one of {keepable} or set "
                "ac_keep_attention: false"
            )
        if self.data.sources and "weight" in self.data.sources[0] and self.train.steps is None:
            raise RecipeError(
                "train.epochs: a mixture by weight has no epochs (its sources are drawn from, each at its own pace); "
                "set train.steps, or give each source epochs"
            )
        streaming = self.data.dataset is not None and self.data.dataset.get("streaming")
        if streaming and self.train.steps is None:
            raise RecipeError(
                "train.epochs: a streaming dataset has no step count per epoch (it is not indexed); set train.steps"
            )
        if self.train.eval_interval is not None and not self.data.eval_files:
            raise RecipeError(
                "train.eval_interval is set but data.eval_files is empty: there is nothing to evaluate"
            )
        if self.data.eval_files and self.train.eval_interval is None:
            raise RecipeError(
                "data.eval_files is set but train.eval_interval is None: the eval data would go unused"
            )

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The `ParallelDims` for ``world_size`` ranks (``parallel.dp_shard`` None takes what is left)."""
        p = self.parallel
        dp_shard = p.dp_shard
        if dp_shard is None:
            if world_size % (p.dp_replicate * p.sp):
                raise RecipeError(
                    f"parallel: world size {world_size} is not divisible by dp_replicate*sp = {p.dp_replicate}*{p.sp}"
                )
            dp_shard = world_size // (p.dp_replicate * p.sp)
        dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=dp_shard, sp=p.sp, ep=p.ep)
        dims.check_world_size(world_size)
        return dims

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per optimizer step on each DP rank: tokens_per_step / (tokens_per_micro_batch * dp), or
        samples_per_step / (samples_per_micro_batch * dp) for model.task=dit."""
        unit = "tokens" if self.train.tokens_per_step is not None else "samples"
        step, micro = getattr(self.train, f"{unit}_per_step"), getattr(self.train, f"{unit}_per_micro_batch")
        per_micro_step = micro * dp
        if dp < 1 or step % per_micro_step:
            raise RecipeError(
                f"train.{unit}_per_step={step} is not a multiple of "
                f"{unit}_per_micro_batch * dp = {micro} * {dp} = {per_micro_step}; "
                "gradient accumulation must be a whole number of micro-batches"
            )
        return step // per_micro_step


# ---------------------------------------------------------------------------------------------------------------
# Loading, overrides, dumping, help


def builtin_recipes() -> list[str]:
    """Names accepted by `load_recipe` in place of a file (the YAML files shipped in ``recipes/``)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(source: str | os.PathLike, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe from a YAML file or a built-in name, applying ``--section.field=value`` overrides.

    Args:
        source: a YAML path, or a name of `builtin_recipes` (e.g. ``"quickstart"``; ``-`` may stand for ``_``,
            as in ``"quickstart-vlm"``).
        overrides: command-line items: ``--a.b=value`` or the two items ``--a.b``, ``value``. Values are parsed
            by the field's type (`veomni.train.recipe.parse.parse_cli_value`): ``null`` for None,
            ``true``/``false``, ``a,b`` or ``[a, b]`` for lists, flow mappings for dict fields.
    Returns:
        the validated `Recipe`, paths absolute.
    Raises:
        RecipeError: an unreadable source, unknown keys (with a did-you-mean), wrong types, invalid values.
    """
    path = _find_source(source)
    try:
        raw = recipe_parse.load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from err
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: expected a mapping of sections at the top level, found {type(raw).__name__}"
        )
    try:
        return recipe_from_dict(recipe_parse.apply_overrides(Recipe, raw, overrides))
    except RecipeError as err:
        raise RecipeError(f"recipe {path}:\n{err}") from None


def _find_source(source: str | os.PathLike) -> Path:
    text = os.fspath(source)
    path = Path(text)
    if path.is_file():
        return path
    names = builtin_recipes()
    # File stems use underscores; the command line may spell them with hyphens (quickstart-vlm).
    if text.replace("-", "_") in names:
        return RECIPES_DIR / f"{text.replace('-', '_')}.yaml"
    close = difflib.get_close_matches(text, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise RecipeError(f"recipe {text!r} is neither a file nor a built-in recipe{hint}; built-in: {names}")


def recipe_from_dict(raw: Mapping[str, Any]) -> Recipe:
    """Build and validate a `Recipe` from nested plain data (what the YAML holds); every problem reported at once."""
    return recipe_parse.build(Recipe, raw, resolve_path)


def resolve_path(value: Any, *, hub_ids: bool = False) -> Any:
    """Make a path value absolute: ``builtin://X`` -> the packaged asset X, relative -> from the current directory.

    Tuples are resolved item by item; None, mappings (inline model configs), URLs (``scheme://...``) and the words
    ``auto``/``never`` (checkpoint.resume) are returned unchanged. Absolute paths are fixed points, so resolving is
    idempotent. With ``hub_ids``, a value that names no local path and reads as a Hub id (``org/name[@revision]``) is kept
    as written: `veomni.train.hub.fetch_hub_sources` fetches it when the run starts.
    """
    if isinstance(value, tuple):
        return tuple(resolve_path(v, hub_ids=hub_ids) for v in value)
    if not isinstance(value, str) or value in ("auto", "never"):
        return value
    if "://" in value and not value.startswith(BUILTIN_PREFIX):
        return value  # a URL (s3://, file://, memory://, ...): read through fsspec as written
    if hub_ids:
        from veomni.train.hub import hub_id

        if hub_id(value) is not None:
            return value
    if value.startswith(BUILTIN_PREFIX):
        target = ASSETS_DIR / value[len(BUILTIN_PREFIX) :]
        if not target.exists():
            raise RecipeError(f"{value}: no such packaged asset (looked for {target})")
        return str(target)
    return os.path.abspath(os.path.expanduser(value))


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Nested plain data (lists, not tuples) that `recipe_from_dict` turns back into an equal recipe."""
    return recipe_parse.to_plain(recipe)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text, sections in schema order."""
    return recipe_parse.dump_yaml(recipe_to_dict(recipe))


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write `dump_recipe` to ``path`` (parent directories created); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(dump_recipe(recipe), encoding="utf-8")
    return target


def recipe_help() -> str:
    """Every field with its type, default and meaning, grouped by section: the ``--help`` text."""
    return recipe_parse.help_text(Recipe, "Recipe fields (override any with --section.field=value):")


def recipe_fields() -> list[str]:
    """Every leaf field as a dotted key (``model.config``, ``optim.lr``, ...), in schema order."""
    return [key for key, _ in recipe_parse.iter_fields(Recipe)]


__all__ = [
    "ASSETS_DIR",
    "BUILTIN_PREFIX",
    "RECIPES_DIR",
    "CheckpointSection",
    "DataSection",
    "DitSection",
    "LogSection",
    "DpoSection",
    "LoraSection",
    "ModelSection",
    "OpsSection",
    "OptimSection",
    "ParallelSection",
    "Recipe",
    "RecipeError",
    "TrainSection",
    "builtin_recipes",
    "dump_recipe",
    "load_recipe",
    "recipe_fields",
    "recipe_from_dict",
    "recipe_help",
    "recipe_to_dict",
    "resolve_path",
    "save_recipe",
]
