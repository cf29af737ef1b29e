"""`build_model`: construct on meta without init, bind kernels, apply EP + FSDP2, allocate, then load or init.

``backend="hf"`` is the escape hatch for a model veomni's adapters get wrong or do not cover: transformers' own
class, nothing bound, FSDP2 only (sequence and expert parallelism, which need veomni's code paths, are refused).

Order matters: sharding happens on the meta device (no memory), each rank then allocates only its shards, and
values arrive either from a checkpoint (each rank reading its own slices) or from the model's own
``_init_weights`` — the latter is logged as a warning, so a model never trains from random weights by
accident. Non-persistent buffers (rotary ``inv_freq``), which no checkpoint holds, are recomputed by the
model's init in both cases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from veomni.core.compile import compile_blocks
from veomni.core.ep.plan import ExpertPlan
from veomni.core.freeze import freeze_modules
from veomni.core.fsdp import FSDPPolicy, apply_fsdp2, materialize_sharded
from veomni.core.parallel_state import ParallelState
from veomni.kernels import OpsConfig, op_fields
from veomni.models.diffusers.build import build_diffusers_model, check_checkpoint_kind
from veomni.models.hf.kernel_hooks import _has_hf_experts, apply_ops
from veomni.models.hf.output_capture import capture_into_compiled_block
from veomni.models.loading.loader import load_weights
from veomni.models.loading.materialize import buffers_init_fn, hf_init_fn
from veomni.models.loading.quantized import check_not_quantized
from veomni.models.lora import LoraSpec, apply_lora, init_lora
from veomni.models.lora.experts import lora_expert_plan
from veomni.models.lora.state import adapter_keys
from veomni.models.registry import (
    DIFFUSERS_TASK,
    MODELS,
    DiffusersConfig,
    ModelRegistry,
    ResolvedModel,
    config_for_class,
)

logger = logging.getLogger(__name__)


def block_patterns(model: nn.Module) -> tuple[str, ...]:
    """FSDP block globs from the model's ``_no_split_modules`` (e.g. ``("model.layers.*",)``).

    Every module whose class name is listed becomes a block; numeric FQN components become ``*``.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules; pass fsdp_policy=FSDPPolicy(block_patterns=...)"
        )
    patterns = set()
    for fqn, module in model.named_modules():
        if fqn and type(module).__name__ in names:
            patterns.add(".".join("*" if part.isdigit() else part for part in fqn.split(".")))
    if not patterns:
        raise ValueError(
            f"no module of {type(model).__name__} has a class in its _no_split_modules {sorted(names)}; pass "
            "fsdp_policy=FSDPPolicy(block_patterns=...)"
        )
    return tuple(sorted(patterns))


def _compute_dtype(
    dtype: torch.dtype,
    fsdp_policy: FSDPPolicy | None,
    state: ParallelState | None,
    compute_dtype: torch.dtype | None,
) -> torch.dtype:
    """``compute_dtype`` when given, FSDP2's ``param_dtype`` when sharded with mixed precision, else ``dtype``."""
    if compute_dtype is not None:
        return compute_dtype
    if state is not None and fsdp_policy is not None and fsdp_policy.param_dtype is not None:
        return fsdp_policy.param_dtype
    return dtype


def _ops_for_compute(
    ops: OpsConfig, dtype: torch.dtype, fsdp_policy: FSDPPolicy | None, state: ParallelState | None,
    compute_dtype: torch.dtype | None = None,
) -> OpsConfig:  # fmt: skip
    """`OpsConfig.for_compute_dtype` for the dtype the model computes in (`_compute_dtype`), logging a changed
    default."""
    compute = _compute_dtype(dtype, fsdp_policy, state, compute_dtype)
    adapted = ops.for_compute_dtype(compute)
    if adapted.attention != ops.attention:
        logger.info(
            "build_model: default attention %r runs bf16/fp16 only and this model computes in %s: using %r "
            "(set ops.attention to choose)", ops.attention, compute, adapted.attention,
        )  # fmt: skip
    return adapted


def untied_lm_head(model: nn.Module) -> str | None:
    """``"lm_head"`` when ``model`` has an LM head sharing no parameter with the rest (its own FSDP unit, see
    `FSDPPolicy.head`), else None (no head, or one tied to the input embeddings)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        return None
    own = {id(p) for p in head.parameters()}
    outside = (n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in own)
    if not own or any(not n.startswith("lm_head.") for n in outside):
        return None
    return "lm_head"


def default_fsdp_policy(model: nn.Module, *, head_unit: bool = True) -> FSDPPolicy:
    """Blocks from `block_patterns`, parameters kept in their stored dtype, gradients reduced in fp32, and (with
    ``head_unit``, the default) an untied LM head as its own unit (`untied_lm_head`)."""
    return FSDPPolicy(
        block_patterns=block_patterns(model),
        param_dtype=None,
        reduce_dtype=torch.float32,
        head=untied_lm_head(model) if head_unit else None,
    )


def _expert_plan(model: nn.Module, given: ExpertPlan | None, resolved: ResolvedModel, ep: int) -> ExpertPlan:
    if given is not None:
        if not isinstance(given, ExpertPlan):
            raise TypeError(f"expert_plan must be a veomni.core.ExpertPlan, got {type(given).__name__}")
        return given
    getter = getattr(model, "get_parallel_plan", None)
    if getter is None:
        raise ValueError(
            f"expert parallelism is on (ep={ep}) but {resolved.cls.__name__} has no get_parallel_plan() "
            f"(its fast paths: {sorted(resolved.fast_paths)}); pass expert_plan=ExpertPlan(...) or use ep=1"
        )
    plan = getter()
    if not isinstance(plan, ExpertPlan):
        raise TypeError(
            f"{resolved.cls.__name__}.get_parallel_plan() returned {type(plan).__name__}, not an ExpertPlan"
        )
    return plan


def _retie(model: PreTrainedModel) -> None:
    model.tie_weights()
    for target, source in model.get_expanded_tied_weights_keys(all_submodels=True).items():
        if model.get_parameter(target) is not model.get_parameter(source):
            raise RuntimeError(f"build_model: {target} should be tied to {source} but is a separate tensor")


def _check_hf_backend(
    ops: OpsConfig | None, state: ParallelState | None, expert_plan: ExpertPlan | None
) -> None:
    # Everything the unpatched class cannot honour is refused, not ignored.
    if ops is not None:
        raise ValueError(
            "build_model(backend='hf') binds no veomni kernels, so it takes no OpsConfig; pass ops=None (or use "
            "backend='veomni')"
        )
    if expert_plan is not None or (state is not None and state.ep_enabled):
        raise ValueError(
            "build_model(backend='hf') has no expert parallelism (it needs veomni's experts path); use ep=1 or "
            "backend='veomni'"
        )
    if state is not None and state.sp_enabled:
        raise ValueError(
            f"build_model(backend='hf') has no Ulysses sequence parallelism (sp={state.dims.sp}: it needs veomni's "
            "attention); use sp=1 or backend='veomni'"
        )


def _device(
    init_device: str | torch.device, state: ParallelState | None, device: str | torch.device | None
) -> torch.device:
    if state is not None:
        if device is not None and torch.device(device) != state.device:
            raise ValueError(f"device={device!r} contradicts parallel_state.device={state.device}")
        return state.device
    if device is not None:
        return torch.device(device)
    init = torch.device(init_device)
    return torch.device("cpu") if init.type == "meta" else init


def build_model(
    config_or_path: PretrainedConfig | str | os.PathLike,
    *,
    weights: str | os.PathLike | None = None,
    ops: OpsConfig | None = None,
    parallel_state: ParallelState | None = None,
    init_device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
    task: str | None = None,
    fsdp_policy: FSDPPolicy | None = None,
    expert_plan: ExpertPlan | None = None,
    load_mode: str = "sharded",
    ignore_unexpected: Sequence[str] = (),
    config_overrides: Mapping[str, object] | None = None,
    device: str | torch.device | None = None,
    registry: ModelRegistry | None = None,
    backend: str = "veomni",
    freeze: Sequence[str] = (),
    compute_dtype: torch.dtype | None = None,
    from_checkpoint: bool = False,
    lora: LoraSpec | None = None,
    lora_dtype: torch.dtype = torch.float32,
    lora_seed: int = 0,
    zero_init: Sequence[str] = (),
) -> PreTrainedModel | nn.Module:
    """Build a model (sharded when ``parallel_state`` is given) and fill it from ``weights`` or its own init.

    Args:
        config_or_path: a config, or a directory / ``config.json`` (read with the registered config class). A
            diffusers ``config.json`` (``_class_name``) or `DiffusersConfig` builds that diffusers class through
            `veomni.models.diffusers.build.build_diffusers_model` (no EP; ``sp > 1`` and an `OpsConfig` apply its
            family's `veomni.models.family.DiffusionRules` -- Wan: `veomni.models.wan.sp`, `veomni.models.wan.kernels`
            -- and are refused for a model without them; ``ops`` None keeps diffusers' attention code; blocks compile
            as below).
        weights: a safetensors checkpoint (file, index or directory) of the same library as the config (a
            transformers checkpoint for a diffusers model, or the reverse, is a `CheckpointKindError`); None
            initialises with the model's ``_init_weights`` (diffusers: its ``__init__``) and says so in the
            log (warning).
        ops: the kernel choice, bound with `veomni.models.hf.kernel_hooks.apply_ops` (also sets attention); required
            with ``backend="veomni"``, refused with ``backend="hf"``. ``ops.compile_enabled`` compiles every
            block (`veomni.core.compile.compile_blocks`, inductor) before FSDP2 and checkpointing. MoE blocks
            compile only with ``moe_experts="torch"`` and no EP (``"auto"`` leaves others eager, ``"on"`` raises).
            Compiled blocks take the eager formulas of the defaulted fields of ``COMPILED_BLOCK_DEFAULTS``
            (rms_norm, rope, rope_vision, swiglu: inductor fuses them; `OpsConfig.for_compiled_blocks`).
        parallel_state: apply FSDP2 (and EP when ``ep > 1``) on its meshes; None builds a plain model.
        init_device: ``"meta"`` (construct without memory, then allocate shards) or a real device to
            construct on directly.
        dtype: parameter dtype (fp32 master weights by default; checkpoint values are cast to it).
        task: which class of the model type (``causal_lm``, ``image_text_to_text``, ``any_to_any``, ``base``,
            ...; see `registry.TASKS`); a task the model lacks is an error naming the tasks it has. None:
            ``causal_lm`` for a transformers config, ``diffusion_transformer`` for a diffusers one.
        fsdp_policy: default `default_fsdp_policy` (blocks from ``_no_split_modules``, no mixed precision).
        expert_plan: overrides the model's ``get_parallel_plan()`` under EP.
        load_mode: ``"sharded"`` or ``"rank0_broadcast"`` (see `load_weights`).
        ignore_unexpected: regexes of checkpoint keys that may be skipped.
        config_overrides: config attributes to set before construction; every key is checked against the
            config class (an unknown key is an error with did-you-mean suggestions; ``text_config`` mappings or
            dotted ``text_config.x`` keys for composite configs), see `veomni.models.registry.check_config_keys`.
        device: the compute device without ``parallel_state`` (default: ``init_device``, or CPU for meta).
        registry: where model types are resolved (default `MODELS`).
        backend: ``"veomni"`` (registered adapters, veomni kernels and attention) or ``"hf"``: the escape hatch
            that trains transformers' own Auto class for ``task``, unpatched, even for a registered model type:
            no veomni kernels, no veomni attention (so no Ulysses SP or packed varlen), no expert parallelism;
            FSDP2 only. A warning names what is off.
        freeze: module-name globs (`veomni.core.freeze.freeze_modules`) whose parameters are frozen before
            FSDP2 wraps the model: no gradient, no reduction; a pattern matching nothing is an error.
        compute_dtype: the dtype forward and backward will run in when the caller casts the parameters itself
            after the build (`veomni.core.master_weights.apply_master_weights` over the fp32 ``dtype``); it only
            chooses the kernels, as FSDP2's ``param_dtype`` does. Refused together with a ``parallel_state``.
        from_checkpoint: the caller fills every parameter from a training checkpoint next (a DCP resume):
            ``weights`` is not read (its ``generation_config.json`` still is) and the parameters are left
            uninitialised on a meta build (buffers computed), with no random init either.
        lora: LoRA adapters (`veomni.models.lora`) on the layers it selects, added before FSDP2 and compilation;
            every other parameter is frozen (stored in ``dtype``). The adapters are not read from ``weights``: they
            start from ``lora.init`` seeded by ``lora_seed`` (the same values on any sharding), or from the PEFT
            adapter ``lora.init_from``. Not for diffusers models yet.
        lora_dtype: the adapters' storage dtype (the optimizer steps them; fp32 by default).
        zero_init: parameter names the checkpoint does not hold, started at zero after the load (a new
            classification head on a causal-LM checkpoint); logged.
    Returns:
        the model: materialised, on the compute device, parameters as DTensors under FSDP.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"build_model: dtype must be a floating torch.dtype, got {dtype!r}")
    if compute_dtype is not None and parallel_state is not None:
        raise ValueError(
            "build_model: compute_dtype is for plain modules cast by the caller; under a parallel_state set "
            "fsdp_policy.param_dtype"
        )
    if backend not in ("veomni", "hf"):
        raise ValueError(f"build_model: backend must be 'veomni' or 'hf', got {backend!r}")
    registry = MODELS if registry is None else registry
    compute = _device(init_device, parallel_state, device)
    on_meta = torch.device(init_device).type == "meta"
    config = registry.load_config(config_or_path, **dict(config_overrides or {}))
    if isinstance(config, DiffusersConfig):
        if lora is not None:
            raise ValueError(
                "build_model: LoRA on diffusers models (diffusers' adapter format) is not built yet"
            )
        # diffusers' own class either way; ops (None: diffusers' own attention code) binds veomni's kernels.
        if ops is not None:
            if backend == "hf":
                _check_hf_backend(ops, parallel_state, expert_plan)
            ops = _ops_for_compute(ops, dtype, fsdp_policy, parallel_state, compute_dtype)
        resolved = registry.model_class(config, task or DIFFUSERS_TASK, backend=backend)
        return build_diffusers_model(
            config,
            resolved.cls,
            weights=weights,
            parallel_state=parallel_state,
            compute=compute,
            on_meta=on_meta,
            dtype=dtype,
            fsdp_policy=fsdp_policy,
            load_mode=load_mode,
            ignore_unexpected=ignore_unexpected,
            freeze=freeze,
            ops=ops,
            expert_plan=expert_plan,
            from_checkpoint=from_checkpoint,
        )
    # Before anything is built: a quantized model would be trained on values read without their scales.
    check_not_quantized(config, where=f"the {config.model_type!r} config")
    if backend == "hf":
        _check_hf_backend(ops, parallel_state, expert_plan)
    elif not isinstance(ops, OpsConfig):
        raise TypeError(f"build_model: ops must be a veomni.kernels.OpsConfig, got {type(ops).__name__}")
    resolved = registry.model_class(config, task or "causal_lm", backend=backend)
    config = config_for_class(config, resolved.cls)
    with torch.device(init_device), no_init_weights():
        model = resolved.cls._from_config(config, dtype=dtype)
    # post_init ties inside init_weights, which no_init_weights skipped.
    model.tie_weights()
    if freeze:
        frozen = freeze_modules(model, freeze, where="build_model(freeze=...)")
        logger.info("build_model: froze %d parameter tensors of %s", len(frozen), freeze)
    if lora is not None:
        # Before kernels, compilation and FSDP2: the adapters belong to the blocks that are compiled and sharded.
        apply_lora(model, lora, adapter_dtype=lora_dtype)
    if not on_meta and parallel_state is None:
        model.to(compute)  # FSDP moves sharded models itself
    if backend == "veomni":
        ops = _ops_for_compute(ops, dtype, fsdp_policy, parallel_state, compute_dtype)  # type: ignore[arg-type]
        computes_in = _compute_dtype(dtype, fsdp_policy, parallel_state, compute_dtype)
        compiling = _will_compile_blocks(model, ops, parallel_state, computes_in)  # type: ignore[arg-type]
        if compiling:
            adapted = ops.for_compiled_blocks()
            if adapted != ops:
                logger.info(
                    "build_model: compiled blocks fuse the eager formulas of the defaulted %s (inductor beats our "
                    "Triton custom ops there); set them in ops to choose",
                    sorted(f for f in op_fields() if getattr(adapted, f) != getattr(ops, f)),
                )
            ops = adapted
        apply_ops(model, ops)
        # Before FSDP2 and activation checkpointing, which then shard / wrap the compiled blocks.
        if compiling:
            compile_blocks(
                model,
                fsdp_policy.block_patterns if fsdp_policy is not None else block_patterns(model),
                call_context=capture_into_compiled_block,
            )
    else:
        logger.warning(
            "build_model(backend='hf'): training transformers' own %s, unpatched. Off: veomni kernels (no "
            "OpsConfig: HF's RMSNorm/RoPE/SwiGLU/loss/experts code runs), veomni attention (HF's %r: no Ulysses "
            "SP, no packed varlen attention), expert parallelism. Only FSDP2 (given a parallel_state) is applied.",
            resolved.cls.__name__,
            model.config._attn_implementation,
        )

    policy = None
    if parallel_state is not None:
        if parallel_state.dims.sp > 1 and "sp" not in resolved.fast_paths:
            raise ValueError(
                f"build_model: parallel_state has sp={parallel_state.dims.sp} but {resolved.cls.__name__} "
                f"(model_type {getattr(config, 'model_type', None)!r}, task {task!r}) does not support Ulysses "
                f"sequence parallelism (its fast paths: {sorted(resolved.fast_paths)}); train it with sp=1"
            )
        plan = None
        if parallel_state.ep_enabled:
            plan = _expert_plan(model, expert_plan, resolved, parallel_state.dims.ep)
            if lora is not None:  # per-expert adapters are sliced with their experts
                plan = lora_expert_plan(model, plan)
        elif expert_plan is not None:
            raise ValueError("build_model: expert_plan was given but parallel_state has ep=1")
        policy = default_fsdp_policy(model) if fsdp_policy is None else fsdp_policy
        apply_fsdp2(model, parallel_state, policy, plan)
    elif expert_plan is not None:
        raise ValueError("build_model: expert_plan needs a parallel_state with ep > 1")

    name = resolved.cls.__name__
    fresh = weights is None and not from_checkpoint  # initialised by the model's own init
    if on_meta:
        init_fn = hf_init_fn(model) if fresh else buffers_init_fn(model)
        materialize_sharded(model, compute, init_fn, cpu_offload=bool(policy and policy.cpu_offload))
    elif fresh:
        with torch.no_grad():
            model.apply(hf_init_fn(model, check_buffers=False))
    # to_empty (from meta) re-creates parameters module by module, which unties a plain (non-FSDP) model.
    _retie(model)
    if from_checkpoint:
        if weights is not None:
            _attach_generation_config(model, weights)
        logger.info(
            "build_model: %s built without reading %s: its parameters are to be loaded from a training checkpoint",
            name,
            weights if weights is not None else "weights",
        )
    elif weights is None:
        logger.warning(
            "build_model: no weights given: the parameters of %s are initialised by its own _init_weights "
            "(random, seed-dependent), not loaded from a checkpoint",
            name,
        )
    else:
        check_checkpoint_kind(weights, "transformers", f"transformers {name}")
        report = load_weights(
            model, weights, mode=load_mode, ignore_unexpected=ignore_unexpected,
            not_in_checkpoint=(*(adapter_keys(model) if lora is not None else ()), *zero_init),
        )  # fmt: skip
        with torch.no_grad():
            for name in zero_init:  # a new head on a checkpoint without one (a reward model from an SFT model)
                model.get_parameter(name).zero_()
        if zero_init:
            logger.info("build_model: %s not in %s: started at zero", list(zero_init), weights)
        _attach_generation_config(model, weights)
        logger.info(
            "build_model: loaded %d tensors of %s from %s (%s, %.1f MiB read on this rank)",
            len(report.loaded),
            name,
            weights,
            report.mode,
            report.bytes_read / 2**20,
        )
        if report.ignored:
            # Whole sub-models can be skipped (an Omni checkpoint's talker / token2wav when the thinker is
            # trained): say which and how many, so nothing is dropped without a word.
            by_prefix: dict[str, int] = {}
            for key in report.ignored:
                by_prefix[key.split(".", 1)[0]] = by_prefix.get(key.split(".", 1)[0], 0) + 1
            logger.warning(
                "build_model: %d checkpoint tensors not loaded into %s (known-harmless per the model's ignore "
                "patterns), by top-level prefix: %s",
                len(report.ignored),
                name,
                by_prefix,
            )
    if lora is not None:
        init_lora(model, lora, lora_seed)
    return model


def _will_compile_blocks(
    model: nn.Module, ops: OpsConfig, state: ParallelState | None, compute: torch.dtype
) -> bool:
    """Whether `build_model` compiles the decoder blocks (`veomni.core.compile.compile_blocks`):
    ``ops.compile_enabled`` and nothing in them untraceable; with ``compile="on"`` an untraceable block raises."""
    if not ops.compile_enabled:
        return False
    problem = None
    if _has_hf_experts(model):
        if state is not None and state.ep_enabled:
            problem = "expert parallelism reads its all-to-all split sizes on the host (one sync per layer)"
        elif ops.moe_experts != "torch":
            problem = (
                f"moe_experts={ops.moe_experts!r} cannot be traced (of the experts backends only 'torch' can)"
            )
        elif ops.hardware.device_type == "cuda" and compute != torch.bfloat16:
            # torch's CUDA _grouped_mm kernels are bf16-only; other dtypes run an eager per-expert fallback whose
            # fake-tensor rule dynamo refuses (measured on torch 2.11, fp32 compute, H200).
            problem = (
                f"torch._grouped_mm is traced on CUDA in bfloat16 only, and this model computes in {compute}"
            )
    config = getattr(model, "config", None)
    # A composite (vision-language) config keeps the decoder's layer kinds in its text config.
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if problem is None and "linear_attention" in (getattr(text_config, "layer_types", None) or ()):
        # Gated DeltaNet hybrids (Qwen3-Next): fla's Triton autograd functions and the eager oracle's
        # per-document loop are not traced with fullgraph=True (not yet verified on GPU).
        problem = "Gated DeltaNet layers (linear_attention) are not traced with fullgraph=True yet"
    if problem is not None:
        if ops.compile == "auto":
            logger.info("build_model: ops.compile='auto' leaves the blocks eager: %s", problem)
            return False
        raise ValueError(f"build_model: ops.compile='on' cannot compile the blocks: {problem}; use 'off'")
    return True


def _attach_generation_config(model: PreTrainedModel, weights: str | os.PathLike) -> None:
    # As from_pretrained does: the checkpoint's sampling defaults and stop tokens, which the model config does
    # not hold (Qwen3 lists two EOS ids there), travel with the model and so into `export_hf`.
    root = os.fspath(weights)
    root = root if os.path.isdir(root) else os.path.dirname(root)
    if model.can_generate() and os.path.isfile(os.path.join(root, "generation_config.json")):
        model.generation_config = model.generation_config_class.from_pretrained(root)
