"""The sections of a training recipe that say how the run goes: optim, train, checkpoint, log and dit (see
`veomni.train.recipe.sections` for the conventions and the model, data, parallel and ops sections).
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

from veomni.train.recipe.parse import RecipeError
from veomni.train.recipe.sections import _field


@attrs.frozen(kw_only=True)
class OptimSection:
    lr: float = _field(3e-4, "peak learning rate (AdamW)")
    betas: tuple[float, float] = _field((0.9, 0.95), "AdamW betas")
    eps: float = _field(1e-8, "AdamW epsilon")
    weight_decay: float = _field(0.1, "decoupled weight decay")
    schedule: Literal["cosine", "linear", "constant"] = _field(
        "cosine", "decay after warmup, from lr toward lr * min_lr_ratio, which step total_steps would reach"
    )
    warmup_steps: int = _field(0, "linear warmup from 0 to lr over this many steps")
    min_lr_ratio: float = _field(0.1, "final lr as a fraction of lr (cosine and linear)")
    max_grad_norm: float | None = _field(1.0, "clip the global gradient norm to this (None: no clipping)")
    lr_multipliers: dict = _field(
        dict,
        "lr multiplier per module or parameter name glob, e.g. {model.visual: 0.1}; the deepest matching name "
        "on a parameter's path wins; a name matching no trainable parameter is an error",
        factory=True,
        dotted_keys=True,
    )
    on_resume: Literal["saved", "recipe"] = _field(
        "saved",
        "saved: a resume keeps the checkpoint's lr, betas, eps and weight_decay (the exact continuation); recipe: "
        "take this recipe's values instead (e.g. a lower optim.lr after a divergence), multipliers kept",
    )
    moe_bias_update_speed: float = _field(
        0.0,
        "DeepSeek-V3 auxiliary-loss-free balancing: after each step every router's e_score_correction_bias moves by "
        "this toward balance (+speed for experts below the mean load, -speed above; DeepSeek used 0.001); 0 keeps "
        "the bias fixed, as transformers does",
    )

    def __attrs_post_init__(self) -> None:
        # NaN passes every `x < 0` test; these checks are written so that NaN (and inf where it matters) fails them.
        if not 0 < self.lr < math.inf:
            raise RecipeError(f"optim.lr: expected a finite value > 0, found {self.lr}")
        if not self.eps >= 0:
            raise RecipeError(f"optim.eps: expected >= 0, found {self.eps}")
        if not self.weight_decay >= 0:
            raise RecipeError(f"optim.weight_decay: expected >= 0, found {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise RecipeError(f"optim.betas: expected two values in [0, 1), found {list(self.betas)}")
        if self.warmup_steps < 0:
            raise RecipeError(f"optim.warmup_steps: expected >= 0, found {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise RecipeError(f"optim.min_lr_ratio: expected a value in [0, 1], found {self.min_lr_ratio}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise RecipeError(f"optim.max_grad_norm: expected > 0 or None, found {self.max_grad_norm}")
        bad = {k: v for k, v in self.lr_multipliers.items()
               if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf}  # fmt: skip
        if bad:
            raise RecipeError(f"optim.lr_multipliers: expected numbers >= 0 per name, found {bad}")
        if not 0 <= self.moe_bias_update_speed < math.inf:
            raise RecipeError(
                f"optim.moe_bias_update_speed: expected >= 0, found {self.moe_bias_update_speed}"
            )


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
    eval_interval: int | None = _field(
        None, "evaluate on data.eval_files every this many steps, and after the last step"
    )
    log_interval: int = _field(10, "steps between console metric lines")
    cuda_graphs: bool = _field(
        False,
        "replay each micro-batch's forward and backward from a captured CUDA graph (one GPU, model.task text, "
        "packed rows; see veomni.train.cuda_graphs): removes the host launch cost of host-bound steps",
    )

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
    save_on_signal: bool = _field(
        True,
        "on SIGINT (Ctrl-C), SIGTERM or SIGUSR1 save a complete checkpoint at the next step boundary and exit "
        "(128 + the signal's number); the same SIGINT/SIGTERM again exits at once. False: signals act as usual",
    )

    def __attrs_post_init__(self) -> None:
        for name in ("interval", "keep_last", "hf_export_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RecipeError(f"checkpoint.{name}: expected >= 1 or None, found {value}")


@attrs.frozen(kw_only=True)
class LogSection:
    console: bool = _field(
        True, "print a metrics line every train.log_interval steps, and each evaluation's line, on rank 0"
    )
    tensorboard_dir: str | None = _field(
        None, "write TensorBoard events here (needs veomni-train[tensorboard])", path=True
    )
    wandb_project: str | None = _field(
        None, "log to this Weights & Biases project (needs veomni-train[wandb])"
    )
    source_losses: bool = _field(
        False,
        "with data.sources: show each source's mean loss of the log window on the console line (metrics.jsonl, "
        "TensorBoard and W&B always get them: sources and loss/<name>)",
    )
    profile_steps: tuple[int, int] | None = _field(
        None,
        "[a, b]: profile steps a..b (1-based, inclusive) with the torch profiler: a Chrome trace per rank and a "
        "top-operators table under <checkpoint.dir>/profile/",
    )
    file: str | None = _field(
        None,
        "also append the log to this file: rank 0's lines (metrics, evaluations, info), every rank's warnings "
        "and errors and the line the run ended with, each stamped with time and rank; auto: "
        "<checkpoint.dir>/train.log",
        path=True,
    )

    def __attrs_post_init__(self) -> None:
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last:
                raise RecipeError(
                    f"log.profile_steps: expected [first, last] with 1 <= first <= last, found {list(self.profile_steps)}"
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
    mode: str | None = _field(
        None,
        "the condition mode, one the transformer's family trains (its DiffusionRules.modes; Wan2.1: t2v "
        "text-to-video, i2v image-to-video from first-frame latents and CLIP image embeddings); null: the "
        "family's first (Wan2.1: t2v)",
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
