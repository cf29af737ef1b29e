"""The sections of a training recipe (`veomni.train.recipe.Recipe`): one attrs class per YAML section, every field
typed and documented in its metadata (``help``: the ``--help`` text; ``path``: resolved when loaded;
``required``). Validation that needs one section only lives here; what spans sections is in ``recipe.py``.
This module holds what is trained on what (model, parallel, ops; the data section is in
`veomni.train.recipe.data_section`); `veomni.train.recipe.run_sections` how the run goes (optim, train, checkpoint,
log, dit).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import attrs

from veomni.kernels import OpsConfig
from veomni.train.recipe.parse import RecipeError


def _field(
    default: Any, help: str, *, path: bool | str = False, factory: bool = False, dotted_keys: bool = False
) -> Any:
    meta = {"help": help, "path": path, "dotted_keys": dotted_keys}
    if factory:
        return attrs.field(factory=default, metadata=meta)
    return attrs.field(default=default, metadata=meta)


def _required(help: str, *, path: bool | str = False) -> Any:
    return attrs.field(metadata={"help": help, "path": path, "required": True})


@attrs.frozen(kw_only=True)
class ModelSection:
    config: str | dict | None = _field(
        None,
        "HF model config: a config.json file or a directory holding one, a Hub id (org/name[@revision]), or an "
        "inline mapping with model_type (None: the config in model.weights)",
        path="hub",
    )
    config_overrides: dict = _field(
        dict,
        "entries set on the config read from model.config (a path) or model.weights, e.g. {attention_dropout: 0.0}; "
        "keys are checked against the config class when the run starts (an inline model.config takes them directly)",
        factory=True,
    )
    weights: str | None = _required(
        "HF checkpoint directory (safetensors) or Hub id (org/name[@revision], fetched into the HF cache) to start "
        "from; null trains from a random initialisation (required, so that random weights are never an accident)",
        path="hub",
    )
    tokenizer: str | None = _field(
        None, "directory or Hub id for transformers.AutoTokenizer (None: model.weights)", path="hub"
    )
    task: str = _field(
        "text",
        "training task, a registered name or a task class as 'package.module:Class' (docs/guides): text (causal language modelling on packed documents), vlm (image-text-to-text on "
        "data.kind=multimodal), omni (an omni thinker on data.kind=multimodal rows that may hold audio parts) or dit (a diffusers diffusion transformer trained by flow matching on "
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
        "bfloat16",
        "compute dtype of the forward and backward (float16: with dynamic loss scaling, over float32 parameters)",
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] = _field(
        "float32",
        "dtype the parameters, gradients and AdamW state are kept in: float32 (fp32 master weights, compute in "
        "model.dtype) or model.dtype itself (pure low-precision training, as plain HF runs in bf16: half the "
        "optimizer memory, gradients accumulated in that dtype)",
    )

    def __attrs_post_init__(self) -> None:
        from veomni.train.tasks import task_class

        try:  # a registered name or an importable task class (a user's module): checked with the recipe
            task_class(self.task)
        except ValueError as err:
            raise RecipeError(str(err)) from None
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
        if self.dtype == "float16" and self.param_dtype != "float32":
            # Loss scaling divides the gradients by the scale (2^16 and up), and AdamW's eps (1e-8) and its second
            # moments underflow in fp16: fp16 parameters cannot be trained soundly.
            raise RecipeError(
                "model.param_dtype: model.dtype float16 trains over float32 parameters (fp16 gradients cannot be "
                f"unscaled and fp16 AdamW state underflows); found {self.param_dtype}: set model.param_dtype: float32"
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
class ParallelSection:
    dp_replicate: int = _field(1, "HSDP replicas (gradients all-reduced across them)")
    dp_shard: int | None = _field(None, "FSDP sharding degree (None: world size / (dp_replicate * sp))")
    sp: int = _field(1, "Ulysses sequence-parallel degree (SP peers read the same samples)")
    ep: int = _field(1, "expert-parallel degree (must divide dp_shard * sp)")
    activation_checkpointing: bool = _field(
        False,
        "recompute each decoder layer's forward in backward (less activation memory, ~1/3 more compute)",
    )
    ac_keep_attention: bool = _field(
        False,
        "with activation_checkpointing: save each layer's attention output instead of recomputing it in backward "
        "(skips the costliest recompute at long sequences for [tokens, heads x head_dim] per layer; eager layers "
        "only: needs ops.compile off; ops.attention sdpa, varlen, flash_attn_2 or flash_attn_3 -- another explicit "
        "one is refused here, and a model whose first training forward kept nothing is an error then)",
    )
    reshard_after_forward: bool = _field(
        True, "free gathered layer parameters after forward and gather again in backward (less memory)"
    )
    lm_head_unit: bool = _field(
        True,
        "with FSDP2 and an LM head not tied to the embeddings: shard the head as an FSDP unit of its own, gathered "
        "during the forward and its gradient reduce-scattered during the layers' backward (+2% on a 4-GPU MoE "
        "step); false keeps it in the root unit with the embeddings (reduced after the whole backward)",
    )
    async_ulysses: bool = _field(
        False,
        "with sp > 1: start each of Q, K, V's sequence -> heads all-to-all as soon as it is projected, overlapping "
        "the next projection (and, in backward, the projections' gradients); Qwen3 / Qwen3-MoE adapters",
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
        if self.async_ulysses and (self.sp or 1) < 2:
            raise RecipeError(
                f"parallel.async_ulysses: true overlaps the Ulysses exchange, but parallel.sp is {self.sp}; set "
                "sp > 1 or async_ulysses: false"
            )
        if self.ac_keep_attention and not self.activation_checkpointing:
            raise RecipeError(
                "parallel.ac_keep_attention: true chooses what activation checkpointing keeps, but "
                "parallel.activation_checkpointing is false; set both or neither"
            )


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
    gated_delta_rule: str | None = _field(None, "Gated DeltaNet delta-rule backend (eager, fla)")
    causal_conv1d: str | None = _field(None, "Gated DeltaNet short-convolution backend (eager, fla)")
    rms_norm_gated: str | None = _field(
        None, "Gated DeltaNet output norm RMSNorm(x)*silu(z) backend (eager, fla)"
    )
    log_probs: str | None = _field(
        None, "per-token log-probs/entropy from the LM head (eager, chunked, triton)"
    )
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
