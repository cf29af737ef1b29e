"""`OpsConfig`: which backend runs each op, validated against the hardware; `resolve_kernels` binds it once.

Each field names a backend for one op family (every variant of the op uses it). Leave a field unset to get the
best default for the hardware (`DEFAULT_BACKENDS`); only unset fields are ever remapped. An explicit value that
is unknown, or that this hardware cannot run, is an error naming the alternatives — never a silent fallback.
Allowed values come from the registry, so third-party backends become valid by registering.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from veomni.kernels.hardware import Hardware, detect_hardware
from veomni.kernels.registry import KERNELS, KernelFn, KernelRegistry, KernelSpec

logger = logging.getLogger(__name__)

# Per op, the default backend on each device type. Every OpsConfig field has a row (a test enforces it); a
# default that the hardware cannot run (a missing package, say) falls back to `FALLBACK_BACKENDS` (attention:
# sdpa) or "eager", the reference. CUDA attention defaults to varlen (torch's flash varlen kernel): packed rows
# and vision towers attend per document/image instead of through an [S, S] mask (1.9x a Qwen3-VL step, see
# notebook/benchmarks-log.md); it runs bf16/fp16 only, so `OpsConfig.for_compute_dtype` makes an fp32 model use sdpa.
# NPU column = the reference's Ascend table: torch_npu kernels where one exists, the portable chunk_loss CE, and an
# explicit eager pin for SwiGLU and the load-balancing loss (no NPU kernel; eager is what the reference runs).
DEFAULT_BACKENDS: Mapping[str, Mapping[str, str]] = {
    "attention": {"cuda": "varlen", "npu": "npu", "cpu": "sdpa"},
    "cross_entropy": {"cuda": "triton", "npu": "chunk_loss", "cpu": "eager"},
    "rms_norm": {"cuda": "triton", "npu": "npu", "cpu": "eager"},
    "rope": {"cuda": "triton", "npu": "npu", "cpu": "eager"},
    "rope_vision": {"cuda": "triton", "npu": "npu", "cpu": "eager"},
    "swiglu": {"cuda": "triton", "npu": "eager", "cpu": "eager"},
    "moe_experts": {"cuda": "triton", "npu": "npu", "cpu": "eager"},
    "load_balancing_loss": {"cuda": "triton", "npu": "eager", "cpu": "eager"},
    # Gated DeltaNet ops (Qwen3-Next, Qwen3.5): flash-linear-attention's kernels when the [fla] extra is there.
    "gated_delta_rule": {"cuda": "fla", "npu": "eager", "cpu": "eager"},
    "causal_conv1d": {"cuda": "fla", "npu": "eager", "cpu": "eager"},
    "rms_norm_gated": {"cuda": "fla", "npu": "eager", "cpu": "eager"},
    # Per-token log-probs (+ entropy) from the LM head, for preference and RL losses; NPU: the portable chunks.
    "log_probs": {"cuda": "triton", "npu": "chunked", "cpu": "eager"},
}
FALLBACK_BACKENDS: Mapping[str, str] = {"attention": "sdpa"}
# Ops only some models call: a default of theirs that falls back is reported when a model first takes the kernel
# (`Kernels.get`), not when the config is built, so a Llama run on a GPU host without fla logs nothing about fla.
MODEL_SPECIFIC_OPS = frozenset({"gated_delta_rule", "causal_conv1d", "rms_norm_gated"})
# Inside torch.compile'd blocks inductor fuses these ops' eager formulas into the kernels around them, which beats
# calling our Triton kernels there: each custom-op call costs 0.2-0.5 ms of host time (Triton's Python launcher)
# and the compiled step is host-bound (T1, Qwen3-1.7B on an H100: 33.1k tok/s with these eager vs 17.8k with
# ours, notebook/benchmarks-log.md 2026-11-25). Eager mode keeps the Triton kernels (fewer launches than eager PyTorch).
# The ViT towers' rope_vision likewise: inductor's fusion of the eager formula times 0.535 ms vs our kernel's 0.533
# (Qwen2.5-VL-7B tower shape; eager PyTorch 2.33 ms), so compiled vision blocks take the formula too.
COMPILED_BLOCK_DEFAULTS: Mapping[str, str] = {
    "rms_norm": "eager", "rope": "eager", "rope_vision": "eager", "swiglu": "eager",
}  # fmt: skip
# Attention backends that take bf16/fp16 inputs only.
HALF_PRECISION_ATTENTION = frozenset({"varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4"})
# The registry op that each field selects for (one op per field).
FIELD_OPS: Mapping[str, str] = {field: field for field in DEFAULT_BACKENDS}


def _optional_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"OpsConfig.{attribute.name} must be a backend name (str) or None, got {value!r}")


def _backend_field() -> Any:
    return attrs.field(default=None, validator=_optional_str)


COMPILE_CHOICES = ("auto", "on", "off")


def _compile_choice(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in COMPILE_CHOICES:
        raise ValueError(f"OpsConfig.compile must be one of {COMPILE_CHOICES}, got {value!r}")


@attrs.frozen(kw_only=True)
class OpsConfig:
    """Backend per op. After construction every field holds a concrete, runnable backend name.

    Attributes:
        attention, cross_entropy, rms_norm, rope, rope_vision, swiglu, moe_experts, load_balancing_loss,
        gated_delta_rule, causal_conv1d, rms_norm_gated, log_probs:
            backend names (``eager``, ``triton``, ``torch``, ``liger``, ``sdpa``, ``npu``, ...) or None for the
            hardware default.
        compile: ``torch.compile`` each decoder block (``fullgraph=True``, veomni's Triton kernels inside as
            custom ops): ``"on"``, ``"off"`` or ``"auto"`` (on for CUDA, off elsewhere); see `compile_enabled`.
        hardware: what to validate against (detected when omitted).
        registry: where backends are looked up (the global `KERNELS` unless a test passes its own).
        defaulted: the fields that were left unset and so got the hardware default.
        fallbacks: for each defaulted field whose device default could not run, the warning saying why and what
            runs instead (logged at construction; for `MODEL_SPECIFIC_OPS`, when a model first takes the kernel).
    """

    attention: str | None = _backend_field()
    cross_entropy: str | None = _backend_field()
    rms_norm: str | None = _backend_field()
    rope: str | None = _backend_field()
    rope_vision: str | None = _backend_field()
    swiglu: str | None = _backend_field()
    moe_experts: str | None = _backend_field()
    load_balancing_loss: str | None = _backend_field()
    gated_delta_rule: str | None = _backend_field()
    causal_conv1d: str | None = _backend_field()
    rms_norm_gated: str | None = _backend_field()
    log_probs: str | None = _backend_field()
    compile: str = attrs.field(default="auto", validator=_compile_choice)
    hardware: Hardware = attrs.field(factory=detect_hardware)
    registry: KernelRegistry = attrs.field(default=KERNELS, repr=False, eq=False)
    defaulted: frozenset[str] = attrs.field(default=frozenset(), init=False)
    fallbacks: Mapping[str, str] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        defaulted, fallbacks = set(), {}
        for field in op_fields():
            value = getattr(self, field)
            if value is None:
                value, fallback = _default_backend(field, self.hardware, self.registry)
                defaulted.add(field)
                if fallback is not None:
                    fallbacks[field] = fallback
                    if field not in MODEL_SPECIFIC_OPS:
                        logger.warning(fallback)  # loud, not silent: the fast default cannot run here
            else:
                _check_explicit(field, value, self.hardware, self.registry)
            object.__setattr__(self, field, value)
        object.__setattr__(self, "defaulted", frozenset(defaulted))
        object.__setattr__(self, "fallbacks", fallbacks)

    def replace(self, **changes: str) -> OpsConfig:
        """This config with ``changes`` (field -> value) applied. ``defaulted`` and ``fallbacks`` are kept: they
        record how the user's config was completed, which a derived config (an adapted backend) does not change;
        a plain ``attrs.evolve`` would see every field as explicit and lose both."""
        # As a dict of Any: the attrs plugin types evolve's keywords per field, and a **dict[str, str] would
        # have to fit the hardware and registry fields too.
        fields: dict[str, Any] = dict(changes)
        changed = attrs.evolve(self, **fields)
        object.__setattr__(changed, "defaulted", self.defaulted)
        object.__setattr__(changed, "fallbacks", self.fallbacks)
        return changed

    def for_compute_dtype(self, dtype: torch.dtype) -> OpsConfig:
        """This config for a model computing in ``dtype``: a *defaulted* half-precision-only attention backend
        (varlen, flash) becomes ``FALLBACK_BACKENDS["attention"]`` (sdpa) for fp32 compute; an explicit choice
        is kept (the kernel then raises on fp32 inputs, naming the alternatives). ``defaulted`` is unchanged."""
        if (
            "attention" not in self.defaulted
            or self.attention not in HALF_PRECISION_ATTENTION
            or dtype in (torch.bfloat16, torch.float16)
        ):
            return self
        return self.replace(attention=FALLBACK_BACKENDS["attention"])

    def with_compile(self, compile: str) -> OpsConfig:
        """This config with ``compile`` (auto / on / off) replaced; ``defaulted`` is unchanged."""
        return self.replace(compile=compile)

    def for_compiled_blocks(self) -> OpsConfig:
        """This config for a model whose decoder blocks ``torch.compile`` traces: each *defaulted* field in
        ``COMPILED_BLOCK_DEFAULTS`` takes the backend inductor fuses best there (the eager formula); explicit
        choices are kept. ``defaulted`` is unchanged."""
        changes = {
            field: backend
            for field, backend in COMPILED_BLOCK_DEFAULTS.items()
            if field in self.defaulted and getattr(self, field) != backend
        }
        if not changes:
            return self
        return self.replace(**changes)

    def capabilities(self, field: str) -> frozenset[str]:
        """The optional features (e.g. ``sinks``) that the backend selected for ``field`` computes."""
        return self.registry.capabilities(FIELD_OPS[field], getattr(self, field))

    def with_capabilities(self, field: str, needed: Iterable[str], why: str) -> OpsConfig:
        """This config with a backend for ``field`` that computes every capability in ``needed``.

        A *defaulted* backend lacking one is replaced by a capable backend runnable on this hardware
        (``FALLBACK_BACKENDS[field]`` when it is one, else the first in registry order); an explicit choice is
        kept and checked (`require_capabilities` raises naming the alternatives). ``defaulted`` is unchanged.
        """
        needed = frozenset(needed)
        if needed <= self.capabilities(field) or field not in self.defaulted:
            self.require_capabilities(field, needed, why)
            return self
        op = FIELD_OPS[field]
        runnable = [
            b
            for b in self.registry.backends(op)
            if needed <= self.registry.capabilities(op, b)
            and self.registry.backend_problem(op, b, self.hardware) is None
        ]
        if not runnable:
            self.require_capabilities(field, needed, why)  # raises, naming the backends
        pick = FALLBACK_BACKENDS.get(field)
        return self.replace(**{field: pick if pick in runnable else runnable[0]})

    def require_capabilities(self, field: str, needed: Iterable[str], why: str) -> None:
        """Raise ``ValueError`` unless the backend of ``field`` has every capability in ``needed``.

        Args:
            field: an op field (``"attention"``).
            needed: capability names, e.g. ``{"sinks", "sliding_window"}``.
            why: who needs them, for the message (``"gpt_oss (GptOssForCausalLM)"``).
        The message names the missing capabilities and the backends that have all of ``needed`` (and which of
        those run on this hardware).
        """
        needed = frozenset(needed)
        missing = needed - self.capabilities(field)
        if not missing:
            return
        op = FIELD_OPS[field]
        having = [b for b in self.registry.backends(op) if needed <= self.registry.capabilities(op, b)]
        runnable = [b for b in having if self.registry.backend_problem(op, b, self.hardware) is None]
        chosen = "defaulted to" if field in self.defaulted else "set to"
        raise ValueError(
            f"{why} needs {sorted(needed)}, but OpsConfig.{field} is {chosen} {getattr(self, field)!r}, "
            f"which lacks {sorted(missing)}. Backends with all of them: {having}; runnable here: {runnable}"
        )

    @property
    def compile_enabled(self) -> bool:
        """Whether decoder blocks are compiled: ``compile == "on"``, or ``"auto"`` on CUDA."""
        return self.compile == "on" or (self.compile == "auto" and self.hardware.device_type == "cuda")


def op_fields() -> list[str]:
    """The OpsConfig fields that select a backend."""
    return [f.name for f in attrs.fields(OpsConfig) if f.name not in _NOT_BACKENDS]


_NOT_BACKENDS = ("compile", "hardware", "registry", "defaulted", "fallbacks")


def npu_backends(field: str, registry: KernelRegistry = KERNELS) -> list[str]:
    """The backends of ``field`` allowed on an Ascend NPU: those whose every variant declares ``npu`` among its
    device types (eager and plain-torch ones included; CUDA/Triton ones never). The reference's NPU allow-list,
    derived from the registry so a third-party NPU backend becomes allowed by registering."""
    op = FIELD_OPS[field]
    specs = [s for s in registry.specs() if s.op == op]
    return sorted(
        b for b in registry.backends(op) if all("npu" in s.requires.device_types for s in specs if s.backend == b)
    )


def _default_backend(field: str, hw: Hardware, registry: KernelRegistry) -> tuple[str, str | None]:
    """The default backend of ``field`` on ``hw``, and when the device default cannot run, the warning that says
    why and what runs instead."""
    op = FIELD_OPS[field]
    preferred = DEFAULT_BACKENDS[field][hw.device_type]
    problem = registry.backend_problem(op, preferred, hw)
    if problem is None:
        return preferred, None
    fallback = FALLBACK_BACKENDS.get(field, "eager")
    chosen = fallback if registry.backend_problem(op, fallback, hw) is None else "eager"
    return chosen, (
        f"OpsConfig.{field}: the {hw.device_type} default {preferred!r} cannot run ({problem}); using {chosen!r}. "
        "Set the field to choose."
    )


def _check_explicit(field: str, value: str, hw: Hardware, registry: KernelRegistry) -> None:
    op = FIELD_OPS[field]
    known = registry.backends(op)
    if value not in known:
        close = difflib.get_close_matches(value, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"OpsConfig.{field}={value!r} is not a known backend{hint}; allowed: {known}")
    runnable = [b for b in known if registry.backend_problem(op, b, hw) is None]
    if hw.device_type == "npu" and value not in npu_backends(field, registry):
        # The reference's rule: a GPU backend (the GPU defaults included) is rejected on an Ascend NPU.
        raise ValueError(
            f"OpsConfig.{field}={value!r} is a GPU backend and is rejected on an Ascend NPU; allowed on npu: "
            f"{npu_backends(field, registry)}. Runnable here: {runnable}"
        )
    problem = registry.backend_problem(op, value, hw)
    if problem:
        raise ValueError(f"OpsConfig.{field}={value!r} cannot run here: {problem}. Runnable here: {runnable}")


@attrs.frozen
class Kernels:
    """The implementations one `OpsConfig` selects, built once; a model instance keeps its own.

    ``kernels.get("rms_norm", "standard")`` returns the plain tensor function of the backend that
    ``config.rms_norm`` names; ``kernels.get("rope_vision", "full")`` the vision rotary of ``config.rope_vision``.
    """

    config: OpsConfig
    _table: dict[tuple[str, str], KernelFn]
    _missing: Mapping[tuple[str, str], str]
    # The model-specific fallbacks not yet reported (`MODEL_SPECIFIC_OPS`): each is logged once, on first `get`.
    _unreported: set[str] = attrs.field(factory=set)
    # The `MODEL_SPECIFIC_OPS` kernels, built on first `get` (then moved to ``_table``).
    _deferred: dict[tuple[str, str], KernelSpec] = attrs.field(factory=dict)

    def get(self, field: str, variant: str) -> KernelFn:
        """The function for OpsConfig field ``field`` (an op name, or an alias such as rope_vision)."""
        if field in self._unreported:
            self._unreported.discard(field)
            logger.warning(self.config.fallbacks[field])
        key = (field, variant)
        if key in self._table:
            return self._table[key]
        spec = self._deferred.get(key)
        if spec is not None:
            try:
                fn = spec.factory()
            except ImportError as err:
                raise ImportError(
                    f"OpsConfig.{field}={spec.backend!r}: the {spec.op}/{variant} kernel cannot be imported "
                    f"({err}); fix the package or set {field}: eager"
                ) from err
            self._table[key] = fn
            del self._deferred[key]
            return fn
        if key in self._missing:
            raise KeyError(self._missing[key])
        raise KeyError(f"no kernel {field}/{variant}; available: {sorted([*self._table, *self._deferred])}")


def resolve_kernels(config: OpsConfig) -> Kernels:
    """Build every (field, variant) implementation the config selects; variants its backend lacks raise on `get`.

    The `MODEL_SPECIFIC_OPS` kernels are built when a model first takes them: their CUDA default (fla) is a heavy
    optional package that most models never call, and one that fails to import must not break those models. Those
    ops run only in layers that are never compiled (`veomni.models.build`), so the import stays outside traced code.

    Args:
        config: a validated `OpsConfig`.
    Returns:
        `Kernels` holding one callable per available (field, variant).
    """
    registry = config.registry
    table: dict[tuple[str, str], KernelFn] = {}
    missing: dict[tuple[str, str], str] = {}
    deferred: dict[tuple[str, str], KernelSpec] = {}
    for field in op_fields():
        op, backend = FIELD_OPS[field], getattr(config, field)
        for variant in registry.variants(op):
            try:
                spec = registry.get(op, variant, backend)
            except KeyError as err:
                missing[(field, variant)] = f"OpsConfig.{field}={backend!r}: {err.args[0]}"
                continue
            if field in MODEL_SPECIFIC_OPS:
                deferred[(field, variant)] = spec
            else:
                table[(field, variant)] = spec.factory()
    return Kernels(config, table, missing, set(config.fallbacks) & MODEL_SPECIFIC_OPS, deferred)
