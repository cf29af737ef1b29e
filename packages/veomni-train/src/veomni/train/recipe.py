"""Training recipes: a strict attrs schema loaded from YAML with ``--section.field=value`` overrides.

A recipe has eight sections (model, data, parallel, ops, optim, train, checkpoint, log); every field is typed and
documented in its metadata, which `recipe_help` turns into the ``--help`` text. Loading is strict: an unknown key
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
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from veomni.core import ParallelDims
from veomni.kernels import OpsConfig
from veomni.train import recipe_parse
from veomni.train.recipe_parse import RecipeError

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
BUILTIN_PREFIX = "builtin://"


def _field(default: Any, help: str, *, path: bool = False, factory: bool = False) -> Any:
    meta = {"help": help, "path": path}
    if factory:
        return attrs.field(factory=default, metadata=meta)
    return attrs.field(default=default, metadata=meta)


def _required(help: str, *, path: bool = False) -> Any:
    return attrs.field(metadata={"help": help, "path": path, "required": True})


@attrs.frozen(kw_only=True)
class ModelSection:
    config: str | dict | None = _field(
        None,
        "HF model config: a config.json file or a directory holding one, or an inline mapping with model_type "
        "(None: the config in model.weights)",
        path=True,
    )
    config_overrides: dict = _field(
        dict,
        "entries set on the config read from model.config (a path) or model.weights, e.g. {attention_dropout: 0.0}; "
        "keys are checked against the config class when the run starts (an inline model.config takes them directly)",
        factory=True,
    )
    weights: str | None = _required(
        "HF checkpoint directory (safetensors) to start from; null trains from a random initialisation "
        "(required, so that random weights are never an accident)",
        path=True,
    )
    tokenizer: str | None = _field(
        None, "directory for transformers.AutoTokenizer (None: model.weights)", path=True
    )
    task: Literal["text", "vlm", "dit"] = _field(
        "text",
        "training task: text (causal language modelling on packed documents), vlm (image-text-to-text on "
        "data.kind=multimodal) or dit (a diffusers diffusion transformer trained by flow matching on "
        "data.kind=dit, conditioned by the frozen models in dit.condition); it decides the model class, the "
        "inputs, the loss, the FLOPs and the export",
    )
    backend: Literal["veomni", "hf"] = _field(
        "veomni",
        "veomni: our adapters, kernels and attention; hf: transformers' own model class, unpatched, with FSDP2 "
        "only (no kernels, Ulysses SP or expert parallelism; the escape hatch for a model our adapter gets wrong)",
    )
    freeze: tuple[str, ...] = _field(
        (),
        "module names to freeze (globs, * = one name component, e.g. [model.visual]): no gradient, no optimizer "
        "state, no gradient reduction; a name matching nothing is an error",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _field(
        "bfloat16", "compute dtype of the forward and backward"
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] = _field(
        "float32",
        "dtype the parameters, gradients and AdamW state are kept in: float32 (fp32 master weights, compute in "
        "model.dtype) or model.dtype itself (pure low-precision training, as plain HF runs in bf16: half the "
        "optimizer memory, gradients accumulated in that dtype)",
    )

    def __attrs_post_init__(self) -> None:
        if self.config is None and self.weights is None:
            raise RecipeError(
                "model: give model.config (path or inline mapping) or model.weights; both are null"
            )
        if isinstance(self.config, dict) and self.task == "dit":
            raise RecipeError(
                "model.config: model.task=dit takes a diffusers config.json (a file or a directory holding one, "
                "with _class_name), not an inline mapping"
            )
        if isinstance(self.config, dict):
            if "model_type" not in self.config:
                raise RecipeError(
                    f"model.config: an inline config needs a model_type key; found {sorted(self.config)}"
                )
            _check_inline_config(self.config)
            if self.config_overrides:
                raise RecipeError(
                    "model.config_overrides: model.config is an inline mapping; put "
                    f"{sorted(self.config_overrides)} in it instead"
                )
        if self.param_dtype not in ("float32", self.dtype):
            raise RecipeError(
                f"model.param_dtype: expected float32 or model.dtype ({self.dtype}), found {self.param_dtype} "
                "(parameters cannot be stored in a lower precision than the compute dtype)"
            )
        if self.task == "dit" and self.tokenizer is not None:
            raise RecipeError(
                f"model.tokenizer: model.task=dit reads the tokenizer from dit.condition/tokenizer; found "
                f"{self.tokenizer!r} (remove it)"
            )
        if self.tokenizer is None and self.weights is None and self.task != "dit":
            raise RecipeError(
                "model.tokenizer: needed when model.weights is null (no checkpoint to take it from)"
            )

    @property
    def tokenizer_path(self) -> str:
        """The directory the tokenizer is loaded from."""
        return typing.cast(str, self.tokenizer if self.tokenizer is not None else self.weights)


def _check_inline_config(config: dict) -> None:
    # A key the config class does not read would be stored and ignored by transformers: the default model would
    # train. Imported here, not at the top: reading a recipe should not import the modeling stack otherwise.
    from veomni.models.registry import check_config_keys

    values = {k: v for k, v in config.items() if k != "model_type"}
    try:
        check_config_keys(config["model_type"], values, "model.config")
    except (ValueError, KeyError) as err:
        raise RecipeError(str(err).strip("'\"")) from None


@attrs.frozen(kw_only=True)
class DataSection:
    train_files: tuple[str, ...] = _required("training data files (a list; .jsonl or .parquet)", path=True)
    eval_files: tuple[str, ...] = _field(
        (), "evaluation data files, read whole every train.eval_interval steps", path=True
    )
    format: Literal["auto", "jsonl", "parquet"] = _field(
        "auto", "file format; auto decides by extension (.jsonl/.json: jsonl, .parquet: parquet)"
    )
    kind: Literal["text", "conversation", "multimodal", "dit", "dit_latents"] = _field(
        "conversation",
        "text: pre-training on one string per row, every token trained; conversation: role/content messages "
        "rendered by the tokenizer's chat template; multimodal: conversations whose content may list text, "
        "image and video parts, expanded by the model's image and video processors (model.task=vlm); dit: rows of "
        "{video: <frames directory or list of frame files>, caption} or {image: <file>, caption} (model.task=dit); "
        "dit_latents: the latents.jsonl of veomni-dit-embed (conditions encoded offline, model.task=dit)",
    )
    media_root: str | None = _field(
        None,
        "kind=multimodal, dit: directory that relative image/frame paths in the rows are read from (dit: None "
        "reads them relative to the data file's directory)",
        path=True,
    )
    patches_per_micro_batch: int | None = _field(
        None,
        "kind=multimodal: vision patches one micro-batch may hold (the second packing budget beside "
        "train.tokens_per_micro_batch; None: no limit); a row above it is an error naming it",
    )
    video_fps: float | None = _field(
        None,
        "kind=multimodal: frames per second sampled from video files, and the rate a frame-list video without "
        "its own fps was taken at (None: the model's video processor config, fps)",
    )
    video_max_frames: int | None = _field(
        None,
        "kind=multimodal: most frames sampled from one video file; a frame list above it is an error (None: the "
        "model's video processor config, max_frames)",
    )
    text_field: str = _field("text", "kind=text: the row's field holding the text")
    messages_field: str = _field("messages", "kind=conversation: the row's field holding the message list")
    loss_mask_field: str | None = _field(
        "loss_mask",
        "kind=conversation: per-message field (0/1 or bool) that overrides the default loss choice",
    )
    assistant_only_loss: bool = _field(
        True, "kind=conversation: train on assistant messages only (the role headers are never trained)"
    )
    add_eos: bool = _field(True, "kind=text: append the tokenizer's EOS token to every text")
    max_seq_len: int = _field(2048, "longest sample in tokens (at most train.tokens_per_micro_batch)")
    overlong: Literal["truncate", "drop", "error"] = _field(
        "truncate",
        "a sample longer than max_seq_len: keep its first max_seq_len tokens, leave it out, or stop with an "
        "error naming file and row (counts are reported by the data summary)",
    )
    on_bad_row: Literal["error", "skip"] = _field(
        "error",
        "a row that cannot be read or encoded (invalid JSON, a malformed conversation, a missing or corrupt image, "
        "placeholders not matching images, an image over data.patches_per_micro_batch): stop with an error "
        "naming file and row, or leave it out and report it (per kind at startup, in the data summary and "
        "metrics.jsonl); over-long rows follow data.overlong instead",
    )
    max_bad_fraction: float = _field(
        0.01,
        "on_bad_row=skip: the most bad rows a dataset may hold, as a fraction of its rows; more (or every row) "
        "is an error, since that is a broken path or field rather than a few broken rows",
    )
    shuffle: bool = _field(True, "shuffle samples every epoch (seeded by train.seed and the epoch)")
    num_workers: int = _field(2, "DataLoader worker processes that read, tokenise and pack (0: in process)")

    def __attrs_post_init__(self) -> None:
        if not self.train_files:
            raise RecipeError("data.train_files: expected at least one file, found an empty list")
        if self.max_seq_len < 2:
            raise RecipeError(f"data.max_seq_len: expected >= 2, found {self.max_seq_len}")
        if self.num_workers < 0:
            raise RecipeError(f"data.num_workers: expected >= 0, found {self.num_workers}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise RecipeError(f"data.max_bad_fraction: expected 0 <= x <= 1, found {self.max_bad_fraction}")
        if self.patches_per_micro_batch is not None and self.patches_per_micro_batch < 1:
            raise RecipeError(
                f"data.patches_per_micro_batch: expected >= 1, found {self.patches_per_micro_batch}"
            )
        if self.video_fps is not None and not self.video_fps > 0:
            raise RecipeError(f"data.video_fps: expected > 0, found {self.video_fps}")
        if self.video_max_frames is not None and self.video_max_frames < 1:
            raise RecipeError(f"data.video_max_frames: expected >= 1, found {self.video_max_frames}")


@attrs.frozen(kw_only=True)
class ParallelSection:
    dp_replicate: int = _field(1, "HSDP replicas (gradients all-reduced across them)")
    dp_shard: int | None = _field(None, "FSDP sharding degree (None: world size / (dp_replicate * sp))")
    sp: int = _field(1, "Ulysses sequence-parallel degree (SP peers read the same samples)")
    ep: int = _field(1, "expert-parallel degree (must divide dp_shard * sp)")
    activation_checkpointing: bool = _field(
        False,
        "recompute each decoder layer's forward in backward (less activation memory, ~1/3 more compute)",
    )
    reshard_after_forward: bool = _field(
        True, "free gathered layer parameters after forward and gather again in backward (less memory)"
    )
    force_fsdp2: bool = _field(
        False,
        "on one rank, train through FSDP2 on a one-rank mesh as on many ranks; by default one rank trains a plain "
        "module: in model.dtype when model.param_dtype equals it, else in model.dtype over fp32 master weights "
        "held beside the optimizer (same numerics as FSDP2 mixed precision, about twice as fast). On more ranks "
        "FSDP2 always applies",
    )

    def __attrs_post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "sp", "ep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RecipeError(f"parallel.{name}: expected >= 1, found {value}")


@attrs.frozen(kw_only=True)
class OpsSection:
    """One backend name per `veomni.kernels.OpsConfig` field; None picks the hardware default."""

    attention: str | None = _field(None, "attention backend (sdpa, eager, flex, varlen, flash_attn_2, ...)")
    cross_entropy: str | None = _field(None, "cross-entropy backend (eager, liger, ...)")
    rms_norm: str | None = _field(None, "RMSNorm backend (eager, triton, torch, liger, ...)")
    rope: str | None = _field(None, "rotary embedding backend (eager, triton, liger, ...)")
    rope_vision: str | None = _field(None, "vision rotary embedding backend")
    swiglu: str | None = _field(None, "SwiGLU MLP backend (eager, triton, liger, ...)")
    moe_experts: str | None = _field(None, "MoE experts backend (eager, grouped GEMM backends, ...)")
    load_balancing_loss: str | None = _field(None, "MoE load-balancing loss backend (eager, triton)")
    compile: Literal["auto", "on", "off"] = _field(
        "auto",
        "torch.compile each decoder block with the chosen kernels inside: auto (on for CUDA, off elsewhere), on, off",
    )

    def to_ops_config(self, **kwargs: Any) -> OpsConfig:
        """The validated `veomni.kernels.OpsConfig` for this machine (kwargs: ``hardware``, ``registry``).

        Backend names are checked here, not at recipe load: a plugin may register its backend after the recipe
        is read. An unknown or unrunnable name is a ValueError naming the alternatives.
        """
        return OpsConfig(**attrs.asdict(self), **kwargs)


@attrs.frozen(kw_only=True)
class OptimSection:
    lr: float = _field(3e-4, "peak learning rate (AdamW)")
    betas: tuple[float, float] = _field((0.9, 0.95), "AdamW betas")
    eps: float = _field(1e-8, "AdamW epsilon")
    weight_decay: float = _field(0.1, "decoupled weight decay")
    schedule: Literal["cosine", "linear", "constant"] = _field(
        "cosine", "decay after warmup, from lr to lr * min_lr_ratio at the last step"
    )
    warmup_steps: int = _field(0, "linear warmup from 0 to lr over this many steps")
    min_lr_ratio: float = _field(0.1, "final lr as a fraction of lr (cosine and linear)")
    max_grad_norm: float | None = _field(1.0, "clip the global gradient norm to this (None: no clipping)")
    lr_multipliers: dict = _field(
        dict,
        "lr multiplier per module or parameter name glob, e.g. {model.visual: 0.1}; the deepest matching name "
        "on a parameter's path wins; a name matching no trainable parameter is an error",
        factory=True,
    )

    def __attrs_post_init__(self) -> None:
        if self.lr <= 0:
            raise RecipeError(f"optim.lr: expected > 0, found {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise RecipeError(f"optim.betas: expected two values in [0, 1), found {list(self.betas)}")
        if self.warmup_steps < 0:
            raise RecipeError(f"optim.warmup_steps: expected >= 0, found {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise RecipeError(f"optim.min_lr_ratio: expected a value in [0, 1], found {self.min_lr_ratio}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise RecipeError(f"optim.max_grad_norm: expected > 0 or None, found {self.max_grad_norm}")
        bad = {k: v for k, v in self.lr_multipliers.items()
               if isinstance(v, bool) or not isinstance(v, int | float) or v < 0}  # fmt: skip
        if bad:
            raise RecipeError(f"optim.lr_multipliers: expected numbers >= 0 per name, found {bad}")


@attrs.frozen(kw_only=True)
class TrainSection:
    tokens_per_step: int | None = _field(
        None,
        "token budget of one optimizer step, summed over data-parallel ranks (required for model.task "
        "text and vlm)",
    )
    tokens_per_micro_batch: int | None = _field(
        None,
        "token budget of one packed micro-batch on one data-parallel rank, before the SP split (required for "
        "model.task text and vlm)",
    )
    samples_per_step: int | None = _field(
        None,
        "model.task=dit: samples (clips or images) per optimizer step, summed over data-parallel ranks; the DiT "
        "batch contract replaces the token one",
    )
    samples_per_micro_batch: int | None = _field(
        None,
        "model.task=dit: at most this many samples per micro-batch on one data-parallel rank, all of one "
        "(frames, height, width) shape",
    )
    steps: int | None = _field(None, "optimizer steps to run (set exactly one of steps and epochs)")
    epochs: int | None = _field(
        None,
        "passes over the training data (set exactly one of steps and epochs); the step count then comes "
        "from the packed real token counts, never an estimate",
    )
    seed: int = _field(0, "seed of model initialisation, data order and dropout")
    device: Literal["auto", "cpu", "cuda"] = _field("auto", "auto: cuda when available, else cpu")
    eval_interval: int | None = _field(None, "evaluate on data.eval_files every this many steps")
    log_interval: int = _field(10, "steps between console metric lines")

    def __attrs_post_init__(self) -> None:
        if self.seed < 0:
            raise RecipeError(f"train.seed: expected >= 0, found {self.seed}")
        for name in ("tokens_per_step", "tokens_per_micro_batch", "samples_per_step", "samples_per_micro_batch",
                     "log_interval"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RecipeError(f"train.{name}: expected >= 1, found {value}")
        self._check_contract("tokens", "text and vlm")
        self._check_contract("samples", "dit")
        if (self.tokens_per_step is None) == (self.samples_per_step is None):
            raise RecipeError(
                "train: set one batch contract, train.tokens_per_step/tokens_per_micro_batch (model.task text, "
                "vlm) or train.samples_per_step/samples_per_micro_batch (model.task dit); found "
                + (
                    "both"
                    if self.tokens_per_step is not None
                    else "neither (train.tokens_per_step: required, missing)"
                )
            )

    def _check_contract(self, unit: str, tasks: str) -> None:
        step, micro = getattr(self, f"{unit}_per_step"), getattr(self, f"{unit}_per_micro_batch")
        if (step is None) != (micro is None):
            missing = f"{unit}_per_step" if step is None else f"{unit}_per_micro_batch"
            raise RecipeError(
                f"train.{missing}: required, missing (the {unit} contract of model.task {tasks})"
            )
        if step is not None and step % micro:
            raise RecipeError(
                f"train.{unit}_per_step={step} is not a multiple of train.{unit}_per_micro_batch={micro}"
            )
        if (self.steps is None) == (self.epochs is None):
            raise RecipeError(
                f"train: set exactly one of steps and epochs; found steps={self.steps}, epochs={self.epochs}"
            )
        for name in ("steps", "epochs", "eval_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RecipeError(f"train.{name}: expected >= 1 or None, found {value}")


@attrs.frozen(kw_only=True)
class CheckpointSection:
    dir: str = _field(
        "outputs", "run directory: checkpoints, the resolved recipe and HF exports go here", path=True
    )
    interval: int | None = _field(None, "save every this many steps (None: only at the end)")
    save_final: bool = _field(True, "save a checkpoint after the last step")
    keep_last: int | None = _field(None, "keep only the newest this many checkpoints (None: keep all)")
    resume: str = _field(
        "auto", "auto: newest complete checkpoint in dir, if any; never; or a checkpoint path", path=True
    )
    async_save: bool = _field(False, "write checkpoints in the background while training continues")
    hf_export: bool = _field(True, "export HF safetensors (with config and tokenizer) after the last step")
    hf_export_interval: int | None = _field(None, "also export HF safetensors every this many steps")

    def __attrs_post_init__(self) -> None:
        for name in ("interval", "keep_last", "hf_export_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RecipeError(f"checkpoint.{name}: expected >= 1 or None, found {value}")


@attrs.frozen(kw_only=True)
class LogSection:
    console: bool = _field(True, "print a metrics line every train.log_interval steps on rank 0")
    tensorboard_dir: str | None = _field(
        None, "write TensorBoard events here (needs veomni-train[tensorboard])", path=True
    )
    wandb_project: str | None = _field(
        None, "log to this Weights & Biases project (needs veomni-train[wandb])"
    )


@attrs.frozen(kw_only=True)
class DitSection:
    """model.task=dit only: the frozen condition models and the flow-matching inputs (`veomni.train.dit`)."""

    condition: str | None = _field(
        None,
        "Wan diffusers pipeline directory holding the frozen condition models: tokenizer/, text_encoder/ (UMT5), "
        "vae/ (AutoencoderKLWan), scheduler/ (and image_encoder/, image_processor/ for mode i2v); model.weights "
        "is its transformer/ subfolder (or null)",
        path=True,
    )
    condition_init: Literal["pretrained", "random"] = _field(
        "pretrained",
        "pretrained: load the text encoder and VAE weights from dit.condition; random: build them from their "
        "configs with random weights seeded by train.seed (toy runs such as the quickstart; a real run never "
        "wants it)",
    )
    mode: Literal["t2v", "i2v"] = _field(
        "t2v", "t2v: text-to-video; i2v: image-to-video (first-frame latents and CLIP image embeddings)"
    )
    max_sequence_length: int = _field(512, "prompt length in tokens (Wan's pipelines use 512)")
    latent_sample_mode: Literal["sample", "mode"] = _field(
        "sample", "sample: draw latents from the VAE posterior; mode: take its mean"
    )
    prompt_dropout_prob: float = _field(
        0.0, "probability of training a sample on the empty prompt (classifier-free guidance)"
    )
    shift: float | None = _field(
        None, "timestep shift of the training schedule (None: the scheduler config's shift / flow_shift)"
    )
    text_encoder_dtype: Literal["float32", "bfloat16"] = _field(
        "bfloat16", "dtype of the frozen text encoder (the VAE runs in float32, as Wan's pipelines run it)"
    )

    def __attrs_post_init__(self) -> None:
        if self.max_sequence_length < 1:
            raise RecipeError(f"dit.max_sequence_length: expected >= 1, found {self.max_sequence_length}")
        if not 0.0 <= self.prompt_dropout_prob <= 1.0:
            raise RecipeError(
                f"dit.prompt_dropout_prob: expected a value in [0, 1], found {self.prompt_dropout_prob}"
            )
        if self.shift is not None and not self.shift > 0:
            raise RecipeError(f"dit.shift: expected > 0 or None, found {self.shift}")


DIT_KINDS = ("dit", "dit_latents")


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

    def __attrs_post_init__(self) -> None:
        check_task_sections(self)
        if (
            self.train.tokens_per_micro_batch is not None
            and self.data.max_seq_len > self.train.tokens_per_micro_batch
        ):
            raise RecipeError(
                f"data.max_seq_len={self.data.max_seq_len} exceeds train.tokens_per_micro_batch="
                f"{self.train.tokens_per_micro_batch}: a sample must fit in one micro-batch"
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
            by the field's type (`veomni.train.recipe_parse.parse_cli_value`): ``null`` for None,
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


def resolve_path(value: Any) -> Any:
    """Make a path value absolute: ``builtin://X`` -> the packaged asset X, relative -> from the current directory.

    Tuples are resolved item by item; None, mappings (inline model configs) and the words ``auto``/``never``
    (checkpoint.resume) are returned unchanged. Absolute paths are fixed points, so resolving is idempotent.
    """
    if isinstance(value, tuple):
        return tuple(resolve_path(v) for v in value)
    if not isinstance(value, str) or value in ("auto", "never"):
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
