"""Building a diffusers model (a DiT such as ``WanTransformer3DModel``) the veomni way: parameters on meta,
FSDP2 per transformer block, each rank allocating only its shards, weights streamed from
``diffusion_pytorch_model*.safetensors`` by veomni's loader (or diffusers' own init, with a warning).

veomni's kernels and Ulysses SP are the model's family's (`veomni.models.family.DiffusionRules`, found by the
config's ``_class_name``: `veomni.models.diffusers.rules`); a diffusers model no family declares builds with
diffusers' own code, and ``ops`` or ``sp > 1`` are refused for it.

The model *is* the diffusers class, unwrapped: no ``PreTrainedModel`` shell, no config swapping. Its
``config`` stays diffusers' ``FrozenDict``, so ``save_config`` / ``from_pretrained`` / pipelines see exactly
what diffusers would (docs/models.md, "Diffusers models", says why).

Non-persistent buffers (Wan's rotary ``freqs_cos`` / ``freqs_sin``) are computed on the CPU during
construction, as diffusers computes them, and copied back after the meta parameters are allocated: no
checkpoint holds them and diffusers' models have no ``_init_weights`` that could recompute them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from veomni.core.compile import compile_blocks
from veomni.core.freeze import freeze_modules
from veomni.core.fsdp import FSDPPolicy, apply_fsdp2, materialize_sharded
from veomni.core.parallel_state import ParallelState
from veomni.kernels import OpsConfig, op_fields
from veomni.models.diffusers.rules import diffusion_models, find_diffusion_rules, resolve_rule
from veomni.models.loading.loader import load_weights
from veomni.models.loading.safetensors_io import resolve_checkpoint
from veomni.models.loading.targets import unwrapped_class
from veomni.models.registry import DiffusersConfig

logger = logging.getLogger(__name__)

DIFFUSERS_WEIGHTS_STEM = "diffusion_pytorch_model"
TRANSFORMERS_WEIGHTS_STEM = "model"


class CheckpointKindError(ValueError):
    """A transformers checkpoint where a diffusers one is expected, or the other way round."""


def is_diffusers_model(model: nn.Module) -> bool:
    """Whether ``model`` (possibly FSDP-wrapped) is a diffusers ``ModelMixin``; False without diffusers."""
    if importlib.util.find_spec("diffusers") is None:
        return False
    from diffusers import ModelMixin

    return issubclass(unwrapped_class(model), ModelMixin)


def _weights_stem(file: Path) -> str:
    name = file.name
    for suffix in (".safetensors.index.json", ".safetensors"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    # Shards: "<stem>-00001-of-00003".
    parts = name.rsplit("-", 3)
    if len(parts) == 4 and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
        name = parts[0]
    return name


def check_checkpoint_kind(weights: str | os.PathLike, expected: str, what: str) -> None:
    """Refuse a checkpoint of the other library before any tensor is read.

    Args:
        weights: the checkpoint (file, index or directory).
        expected: ``"diffusers"`` or ``"transformers"``.
        what: the model being built, for the message (``"diffusers WanTransformer3DModel"``).
    Raises:
        CheckpointKindError: the weight files or the ``config.json`` next to them belong to the other library
            (diffusers: ``diffusion_pytorch_model*.safetensors`` and ``_class_name``; transformers:
            ``model*.safetensors`` and ``model_type``), or a diffusers config names another ``_class_name``.
    """
    if expected not in ("diffusers", "transformers"):
        raise ValueError(
            f"check_checkpoint_kind: expected must be 'diffusers' or 'transformers', got {expected!r}"
        )
    directory, files, _ = resolve_checkpoint(weights)
    want_stem = DIFFUSERS_WEIGHTS_STEM if expected == "diffusers" else TRANSFORMERS_WEIGHTS_STEM
    other = "transformers" if expected == "diffusers" else "diffusers"
    want = f"{want_stem}*.safetensors[.index.json] and a config.json with " + (
        "'_class_name'" if expected == "diffusers" else "'model_type'"
    )
    source = Path(weights)
    stems = sorted({_weights_stem(f) for f in ([source] if source.is_file() else files)})
    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else None
    found_kind = None
    if isinstance(raw, dict):
        if expected == "diffusers" and "model_type" in raw and "_class_name" not in raw:
            found_kind = f"a transformers checkpoint (model_type {raw['model_type']!r})"
        elif expected == "transformers" and "_class_name" in raw and "model_type" not in raw:
            found_kind = f"a diffusers checkpoint (_class_name {raw['_class_name']!r})"
    other_stem = TRANSFORMERS_WEIGHTS_STEM if expected == "diffusers" else DIFFUSERS_WEIGHTS_STEM
    if found_kind is None and other_stem in stems:
        found_kind = f"a {other} checkpoint (weight files {[f.name for f in files][:4]})"
    if found_kind is not None:
        raise CheckpointKindError(
            f"{weights} is {found_kind}, but a {what} is being built: it expects {want} in the checkpoint "
            "directory"
        )


def _check_class_name(weights: str | os.PathLike, class_name: str) -> None:
    directory, _, _ = resolve_checkpoint(weights)
    config_file = directory / "config.json"
    if not config_file.is_file():
        return
    found = json.loads(config_file.read_text()).get("_class_name")
    if found is not None and found != class_name:
        raise CheckpointKindError(
            f"the checkpoint in {directory} is a diffusers {found!r} (config.json _class_name), but the model "
            f"being built is {class_name!r}; pass the weights of a {class_name!r}"
        )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    # Parameters go to meta as they are registered; buffers are computed for real (the rotary tables), as
    # accelerate's init_empty_weights(include_buffers=False) does for diffusers' own low-memory loading.
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _construct(cls: type, values: Mapping[str, object], *, meta: bool) -> nn.Module:
    from diffusers.models.modeling_utils import no_init_weights

    unknown = sorted(k for k in values if not k.startswith("_") and k not in cls._get_init_keys(cls))
    if unknown:
        # diffusers drops such keys with a warning of its own; say which, in our log too.
        logger.warning(
            "build_model: %s's config keys %s are not arguments of %s; diffusers ignores them",
            cls.__name__,
            unknown,
            cls.__name__,
        )
    if not meta:
        return cls.from_config(dict(values))
    with _parameters_on_meta(), no_init_weights():
        return cls.from_config(dict(values))


def _construct_fresh(cls: type, values: Mapping[str, object], compute: torch.device) -> nn.Module:
    """diffusers' own (random) ``__init__``, its parameters drawn on ``compute`` when they fit there.

    On a GPU the draws take seconds where the CPU takes minutes at 14B; the buffers (Wan's float64 rotary
    tables) are still computed on the CPU and copied in, so the forward stays diffusers' own to the bit.
    """
    if compute.type != "cuda":
        return _construct(cls, values, meta=False)
    reference = _construct(cls, values, meta=True)  # parameters on meta, buffers computed on the CPU
    need = sum(p.numel() * p.element_size() for p in reference.parameters())
    free, _ = torch.cuda.mem_get_info(compute)
    if need > 0.9 * free:  # construction holds the parameters and a few small buffers, nothing else
        logger.info(
            "build_model: %s's fresh parameters (%.1f GiB) do not fit the %.1f GiB free on %s: drawn on the CPU",
            cls.__name__, need / 2**30, free / 2**30, compute,
        )  # fmt: skip
        return _construct(cls, values, meta=False)
    with torch.device(compute):
        model = cls.from_config(dict(values))
    computed = dict(reference.named_buffers())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(computed[name])
    return model


def _cast(model: nn.Module, dtype: torch.dtype, *, keep_fp32: bool) -> None:
    # Parameters only, and as diffusers' from_pretrained(torch_dtype=...) does: with ``keep_fp32`` those under a
    # module named in _keep_in_fp32_modules stay fp32. Buffers keep the dtype diffusers computed them in (Wan's
    # rotary tables are float64), so the forward is diffusers' own to the bit.
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or ()) if keep_fp32 else []
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            fqn = f"{module_name}.{name}" if module_name else name
            want = torch.float32 if any(k in fqn.split(".") for k in keep) else dtype
            if param.dtype != want:
                module._parameters[name] = nn.Parameter(
                    param.detach().to(want), requires_grad=param.requires_grad
                )


def _buffers(model: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (id(module), name): buf.detach().clone()
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None
    }


def _restore_buffers_fn(saved: dict[tuple[int, str], torch.Tensor]):
    def init_fn(module: nn.Module) -> None:
        for name, buf in module._buffers.items():
            if buf is not None:
                buf.copy_(saved[(id(module), name)])

    return init_fn


def _broadcast_from_rank0(model: nn.Module) -> None:
    # Every rank ran diffusers' (random) init; rank 0's values become everyone's, tensor by tensor.
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            moved = tensor.data if device is None else tensor.data.to(device)
            dist.broadcast(moved, src=0)
            if device is not None:
                tensor.data.copy_(moved)


def _refuse(state: ParallelState | None, expert_plan: object, name: str) -> None:
    if expert_plan is not None or (state is not None and state.ep_enabled):
        raise ValueError(
            f"build_model: {name} is a diffusers model without experts; use ep=1, no expert_plan"
        )


def dit_ops(ops: OpsConfig) -> OpsConfig:
    """``ops`` with the DiT's measured defaults for the fields it left *defaulted*; explicit choices are kept.

    * attention -> ``sdpa``: a DiT sample is one unpacked sequence, where the CUDA default ``varlen`` buys nothing
      and measured 1.5x slower (Wan2.1-1.3B self-attention at 32,760 tokens on an H100, fwd+bwd: torch's varlen
      flash 75.5 ms vs SDPA's flash 50.2 ms; docs/benchmarks.md 2026-11-25).
    """
    if "attention" not in ops.defaulted or ops.attention == "sdpa":
        return ops
    return ops.replace(attention="sdpa")


def _supporting(rule: str) -> list[str]:
    return sorted(
        name for name in diffusion_models() if getattr(find_diffusion_rules(name), rule) is not None
    )


def _bind_kernels(model: nn.Module, ops: OpsConfig, class_name: str | None = None) -> bool:
    """Bind ``ops``'s kernels with the family's `DiffusionRules.bind_kernels` (Wan:
    `veomni.models.wan.kernels.bind_wan_kernels`); return whether the blocks compile. ``class_name``: the config's
    ``_class_name`` (default: the model's class name).

    Blocks compile only with ``compile: on``: ``auto`` stays eager for DiTs, whose compiled blocks measured 0.80x
    eager under whole-block checkpointing (the recompute reruns the compiled graph; T9, docs/benchmarks.md).
    Compiled blocks take the eager formulas of the defaulted ``COMPILED_BLOCK_DEFAULTS`` fields (rms_norm, rope:
    inductor fuses them with the adaLN and LayerNorm chains around them; `OpsConfig.for_compiled_blocks`).
    """
    if not isinstance(ops, OpsConfig):
        raise TypeError(
            f"build_model: ops must be a veomni.kernels.OpsConfig or None, got {type(ops).__name__}"
        )
    name = unwrapped_class(model).__name__ if class_name is None else class_name
    rules = find_diffusion_rules(name)
    if rules is None or rules.bind_kernels is None:
        raise ValueError(
            f"build_model: veomni's kernels are bound to the diffusers models {_supporting('bind_kernels')} only, "
            f"not to {name}; build it with ops=None"
        )
    ops = dit_ops(ops)
    compiling = ops.compile == "on"
    if compiling:
        adapted = ops.for_compiled_blocks()
        if adapted != ops:
            logger.info(
                "build_model: compiled DiT blocks fuse the eager formulas of the defaulted %s; set them in ops to "
                "choose", sorted(f for f in op_fields() if getattr(adapted, f) != getattr(ops, f)),
            )  # fmt: skip
        ops = adapted
    resolve_rule(rules, "bind_kernels")(model, ops)
    return compiling


def build_diffusers_model(
    config: DiffusersConfig,
    cls: type,
    *,
    weights: str | os.PathLike | None,
    parallel_state: ParallelState | None,
    compute: torch.device,
    on_meta: bool,
    dtype: torch.dtype,
    fsdp_policy: FSDPPolicy | None,
    load_mode: str,
    ignore_unexpected: Sequence[str],
    freeze: Sequence[str],
    ops: OpsConfig | None = None,
    expert_plan: object = None,
    from_checkpoint: bool = False,
) -> nn.Module:
    """`veomni.models.build.build_model` for a diffusers ``config`` resolved to ``cls`` (see there).

    With ``weights`` (or ``from_checkpoint``, which skips the load: a DCP resume fills them): parameters on meta, FSDP2 per block, shards allocated on ``compute``, rotary buffers
    restored, then `load_weights` (``"sharded"`` or ``"rank0_broadcast"``, strict accounting, no
    converters). Without: diffusers' own ``__init__`` runs on every rank (its parameters drawn on the GPU when
    they fit there, else on the CPU), rank 0's values are broadcast, then FSDP2 shards them (the full model is
    held on each rank once; warned). With
    ``parallel_state.dims.sp > 1``: the family's `DiffusionRules.sequence_parallel` (Wan:
    `veomni.models.wan.sp.apply_dit_sp`; a model without one refused).

    ``ops`` None keeps diffusers' own attention code. An `OpsConfig` binds veomni's RMSNorm / rotary / attention
    kernels with the family's `DiffusionRules.bind_kernels` (Wan: `veomni.models.wan.kernels.bind_wan_kernels`,
    to every ``WanAttention``; a model without one refused) and, when
    ``ops.compile == "on"`` (not ``auto``: see `_bind_kernels`), compiles every block (`veomni.core.compile.compile_blocks`) before FSDP2, so that
    FSDP2 and activation checkpointing wrap the compiled forwards. Parameters and buffers are the same either
    way, so the diffusers export is too.
    """
    from veomni.models.build import block_patterns, default_fsdp_policy

    name = cls.__name__
    _refuse(parallel_state, expert_plan, name)
    sp = parallel_state is not None and parallel_state.sp_enabled
    rules = find_diffusion_rules(config.class_name)
    if sp and (rules is None or rules.sequence_parallel is None):
        raise ValueError(
            f"build_model: Ulysses sequence parallelism (sp={parallel_state.dims.sp}) is implemented for the "
            f"diffusers models {_supporting('sequence_parallel')} only, not for {name}; use sp=1"
        )
    if weights is not None and not from_checkpoint:
        check_checkpoint_kind(weights, "diffusers", f"diffusers {name}")
        _check_class_name(weights, config.class_name)
    fresh = weights is None and not from_checkpoint  # diffusers' own __init__ draws the parameters
    meta = not fresh and on_meta
    model = (
        _construct_fresh(cls, config.values, compute) if fresh else _construct(cls, config.values, meta=meta)
    )
    # FSDP2 needs one stored dtype per unit, and a Wan block holds keep-fp32 parameters (scale_shift_table, the
    # cross-attention norm) beside its linears: with low-precision storage under FSDP2 they are stored in
    # ``dtype`` too (as FSDP2's mixed precision already computes them), instead of failing at the first forward.
    keep_fp32 = parallel_state is None or dtype == torch.float32
    if not keep_fp32 and getattr(model, "_keep_in_fp32_modules", None):
        logger.info(
            "build_model: %s's _keep_in_fp32_modules %s are stored in %s under FSDP2 (one dtype per unit)",
            name, list(model._keep_in_fp32_modules), dtype,
        )  # fmt: skip
    _cast(model, dtype, keep_fp32=keep_fp32)
    compiling = ops is not None and _bind_kernels(model, ops, config.class_name)
    if sp:
        # Explicit: Ulysses SP is attention processors + sequence hooks (Wan: veomni.models.wan.sp), installed
        # while the parameters are still on meta, so a head count SP cannot split fails before allocation.
        resolve_rule(rules, "sequence_parallel")(model, parallel_state)
    if fresh:
        _broadcast_from_rank0(model)
    if freeze:
        frozen = freeze_modules(model, freeze, where="build_model(freeze=...)")
        logger.info("build_model: froze %d parameter tensors of %s", len(frozen), freeze)
    saved = _buffers(model) if meta else {}
    if compiling:
        # After the kernels and SP processors are in place, before FSDP2 / checkpointing wrap the blocks.
        patterns = fsdp_policy.block_patterns if fsdp_policy is not None else block_patterns(model)
        compile_blocks(model, patterns)
    policy = None
    if parallel_state is not None:
        policy = default_fsdp_policy(model) if fsdp_policy is None else fsdp_policy
        apply_fsdp2(model, parallel_state, policy)
        if fresh and compute.type == "cuda":
            torch.cuda.empty_cache()  # the full fresh copy is gone (sharded): its blocks back for training
    if meta:
        materialize_sharded(
            model, compute, _restore_buffers_fn(saved), cpu_offload=bool(policy and policy.cpu_offload)
        )
    elif parallel_state is None:
        model.to(compute)
    if from_checkpoint:
        logger.info(
            "build_model: %s built without reading weights: its parameters are to be loaded from a training "
            "checkpoint",
            name,
        )
        return model
    if weights is None:
        logger.warning(
            "build_model: no weights given: the parameters of %s are initialised by diffusers' own __init__ "
            "(random, seed-dependent; rank 0's values on every rank), not loaded from a checkpoint",
            name,
        )
        return model
    report = load_weights(
        model, weights, mode=load_mode, converters=[], ignore_unexpected=ignore_unexpected, check_config=False
    )
    logger.info(
        "build_model: loaded %d tensors of %s from %s (%s, %.1f MiB read on this rank)",
        len(report.loaded),
        name,
        weights,
        report.mode,
        report.bytes_read / 2**20,
    )
    return model
