"""veomni's MoE experts, registered in HF's experts interface (``ALL_EXPERTS_FUNCTIONS``) as ``"veomni"``.

HF experts classes decorated with ``@use_experts_implementation`` (Qwen3-MoE's ``Qwen3MoeExperts``, with fused
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) dispatch their forward through that interface by
``config._experts_implementation``. `apply_ops` selects ``"veomni"``, which runs:

- without expert parallelism: the ``moe_experts/routed`` kernel of the instance's kernel set, or, when the
  configured backend is ``eager``, the untouched upstream forward;
- with expert parallelism (the module's parameters were sharded by ``apply_expert_plan``): veomni-core's
  ``dispatch_tokens`` -> the ``moe_experts/grouped`` kernel on the local experts -> ``combine_tokens``. The
  upstream eager loop is refused there: it indexes experts by global id and would run on the wrong weights.

The generic kernels (``routed``/``grouped``) compute one thing: SwiGLU experts in HF's default layout. Experts
classes declare other layouts through the decorator's flags (gpt_oss: biases, transposed and interleaved weights,
a clamped gate; nemotron_h: no gate; deepseek_v4: a clamp in ``_apply_gate``), so `check_experts_modules`
refuses, naming the flag, every experts module that differs, before a kernel could silently drop a bias or a
clamp. A layout with kernels of its own is *claimed* explicitly (`claim_experts`): the claim names the exact
class, the kernel variants that compute it and how to call them; only that class (not a subclass, not
transformers' own copy of it) runs those variants, after a numeric check of its gate against the kernels'.

An experts module of the generic layout that carries per-expert LoRA adapters (`veomni.models.lora.experts`: the
module's ``lora_targets`` names the adapted projections, each with ``<name>_lora_A [E, r, in]`` /
``<name>_lora_B [E, out, r]`` beside it) runs the ``lora_routed`` / ``lora_grouped`` variants, which add the
adapters' update inside the grouped GEMMs (`veomni.kernels.moe_experts.lora`); the eager backend then runs the
eager LoRA kernels (the upstream loop knows no adapters), under EP too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import attrs
import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

from veomni.core.ep import combine_tokens, dispatch_tokens, expert_shards
from veomni.core.parallel_state import current_parallel_state
from veomni.kernels import OpsConfig
from veomni.models.hf.kernel_hooks import ATTR

logger = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATION = "veomni"
LORA_ATTR = "lora_targets"
"""Attribute of an experts module with LoRA: the adapted fused parameters (of `LORA_PROJECTIONS`), in module order."""
LORA_PROJECTIONS = ("gate_up_proj", "down_proj")
LORA_SUFFIXES = ("_lora_A", "_lora_B")
"""``<projection><suffix>``: the adapter parameters beside an adapted projection, ``[E, r, in]`` and ``[E, out, r]``."""


def experts_adapters(module: nn.Module) -> tuple[torch.Tensor | None, ...] | None:
    """``(gate_up_A, gate_up_B, down_A, down_B)`` of an experts module with LoRA (None for an unadapted projection,
    the ``lora_*`` kernels' argument order), or None when it has no adapters."""
    adapted = getattr(module, LORA_ATTR, ())
    if not adapted:
        return None
    return tuple(
        getattr(module, f"{name}{suffix}") if name in adapted else None
        for name in LORA_PROJECTIONS
        for suffix in LORA_SUFFIXES
    )


def adapter_param_names(module: nn.Module) -> tuple[str, ...]:
    """The names of the LoRA adapter parameters on an experts module (empty without adapters)."""
    return tuple(f"{name}{suffix}" for name in getattr(module, LORA_ATTR, ()) for suffix in LORA_SUFFIXES)


def veomni_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """HF experts-interface forward.

    Args:
        self: an HF fused experts module (``gate_up_proj [E_local, 2I, H]``, ``down_proj [E_local, H, I]``).
        hidden_states: ``[T, H]``; top_k_index: ``[T, k]`` int64 global expert ids; top_k_weights: ``[T, k]``.
    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    kernels = getattr(self, ATTR, None)
    if kernels is None:
        raise RuntimeError(
            f"{type(self).__name__} uses experts_implementation={EXPERTS_IMPLEMENTATION!r} but has no veomni "
            "kernels attached; bind them with veomni.models.hf.kernel_hooks.apply_ops(model, ops)"
        )
    backend = kernels.config.moe_experts
    claim = claim_of(self)
    shards = expert_shards(self)
    shard = shards.get("gate_up_proj")
    adapters = experts_adapters(self)
    if shard is None or shard.ep_size == 1:
        if adapters is not None:
            _recheck(self, backend)
            routed = kernels.get("moe_experts", "lora_routed")
            return routed(
                hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, *adapters,
                scaling=self.lora_scaling,
            )  # fmt: skip
        if backend == "eager":
            upstream = type(self).forward.__wrapped__  # the class's own forward, under HF's dispatch wrapper
            return upstream(self, hidden_states, top_k_index, top_k_weights)
        _recheck(self, backend)
        if claim is not None:
            routed = kernels.get("moe_experts", claim.routed)
            return routed(
                hidden_states, top_k_index, top_k_weights, *claim.tensors(self), **claim.options(self)
            )
        routed = kernels.get("moe_experts", "routed")
        return routed(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    if backend == "eager" and adapters is None:
        raise ValueError(
            "OpsConfig.moe_experts='eager' runs the upstream per-expert loop, which indexes experts by global id "
            f"and cannot run on expert-parallel shards ({type(self).__name__} holds {shard.local_experts} of "
            f"{shard.num_experts} experts); choose a grouped backend such as 'torch' or 'triton'"
        )
    sharded = claim.params if claim is not None else ("gate_up_proj", "down_proj", *adapter_param_names(self))
    if any(name not in shards for name in sharded):
        raise ValueError(
            f"{type(self).__name__}: {list(sharded)} must all be expert-sharded, found {sorted(shards)}"
        )
    _recheck(self, backend)
    group = current_parallel_state().ep_group
    rows, _, handle = dispatch_tokens(hidden_states, top_k_index, shard.num_experts, group)
    if claim is not None:
        grouped = kernels.get("moe_experts", claim.grouped)
        out = grouped(rows, handle.local_expert_counts, *claim.tensors(self), **claim.options(self))
    elif adapters is not None:
        grouped = kernels.get("moe_experts", "lora_grouped")
        out = grouped(
            rows,
            handle.local_expert_counts,
            self.gate_up_proj,
            self.down_proj,
            *adapters,
            scaling=self.lora_scaling,
        )
    else:
        grouped = kernels.get("moe_experts", "grouped")
        out = grouped(rows, handle.local_expert_counts, self.gate_up_proj, self.down_proj)
    return combine_tokens(out, top_k_weights, handle)


def _recheck(module: nn.Module, backend: str) -> None:
    # A module that reached this forward without apply_ops (set_experts_implementation by hand, or kernels
    # re-attached with another backend) is checked here, once per backend change.
    if getattr(module, _CHECKED, None) != backend:
        problems = module_mismatches(module)
        if problems:
            raise ValueError(
                f"OpsConfig.moe_experts={backend!r} cannot run {type(module).__name__}: "
                + "; ".join(problems)
            )
        setattr(module, _CHECKED, backend)  # accepted: not inspected again on every forward


def register_hf_experts() -> str:
    """Register `veomni_experts_forward` in HF's experts interface (idempotent); returns its name."""
    existing = ALL_EXPERTS_FUNCTIONS._global_mapping.get(EXPERTS_IMPLEMENTATION)
    if existing is not None and existing is not veomni_experts_forward:
        raise ValueError(
            f"experts implementation {EXPERTS_IMPLEMENTATION!r} is already registered by someone else: {existing}"
        )
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, veomni_experts_forward)
    return EXPERTS_IMPLEMENTATION


# The contract of the ``moe_experts`` op (both variants, every non-eager backend), in the flags that HF's
# ``@use_experts_implementation`` sets on an experts instance: gated SwiGLU, ``[gate; up]`` concatenated rows,
# ``[E, out, in]`` weights, no biases, no norm after each expert.
MOE_EXPERTS_CONTRACT: Mapping[str, bool] = {
    "has_gate": True,
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_post_expert_norm": False,
}
_CLAMP_ATTRS = ("limit", "alpha", "swiglu_limit", "swiglu_alpha")
_CHECKED = "_veomni_experts_checked"  # the backend an instance was last accepted for
_MISSING = "<not set>"


@attrs.frozen(kw_only=True)
class ExpertsClaim:
    """A non-default experts layout that dedicated ``moe_experts`` variants compute exactly.

    Attributes:
        name: what the layout is, for messages (``"gpt-oss clamped SwiGLU"``).
        routed, grouped: the ``moe_experts`` variants without / with expert parallelism; they take
            ``(hidden, top_k_index, top_k_weights, *tensors, **options)`` / ``(rows, counts, *tensors, **options)``.
        flags: the ``@use_experts_implementation`` flags the module must carry.
        params: the module's parameter names, in the kernels' argument order (all ``[E, ...]``, all EP-sharded).
        option_attrs: kernel keyword -> module attribute (``{"limit": "limit"}``), read at every call.
        gate_check: ``gate_check(cls)`` returns None when ``cls._apply_gate`` computes the kernels' activation,
            else a description of the difference (run once, at claim time).
    """

    name: str
    routed: str
    grouped: str
    flags: Mapping[str, bool]
    params: tuple[str, ...]
    option_attrs: Mapping[str, str]
    gate_check: Callable[[type], str | None]

    def tensors(self, module: nn.Module) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(module, name) for name in self.params)

    def options(self, module: nn.Module) -> dict[str, object]:
        return {kw: getattr(module, attr) for kw, attr in self.option_attrs.items()}

    def mismatches(self, module: nn.Module) -> list[str]:
        """How ``module`` differs from what the claimed kernels compute (empty when it matches)."""
        found = []
        for flag, expected in self.flags.items():
            value = getattr(module, flag, _MISSING)
            if value is not expected:
                found.append(f"{flag}: expected {expected} ({self.name}), found {value}")
        if getattr(module, "_is_expert_parallel", False):
            found.append(
                "_is_expert_parallel: expected False, found True (transformers' own expert parallelism)"
            )
        params = sorted(name for name, _ in module.named_parameters(recurse=False))
        if params != sorted(self.params):
            found.append(f"parameters: expected {sorted(self.params)} ({self.name}), found {params}")
        for kw, attr in self.option_attrs.items():
            value = getattr(module, attr, None)
            if isinstance(value, bool) or not isinstance(value, int | float):
                found.append(f"{attr}: expected a number (the kernels' {kw}), found {value!r}")
        children = [name for name, _ in module.named_children()]
        if children:
            found.append(f"submodules: expected none ({self.name}), found {children}")
        return found


EXPERTS_CLAIMS: dict[type, ExpertsClaim] = {}
"""Experts class -> its claim; filled by `claim_experts` when a generated modeling file is imported."""


def claim_experts(cls: type, claim: ExpertsClaim) -> type:
    """Declare that ``claim``'s kernel variants compute ``cls`` (exactly that class, not subclasses).

    Raises ``ValueError`` if ``cls``'s gate is not the claimed activation (``claim.gate_check``), so a changed
    upstream gate fails at import instead of training a different model, or if ``cls`` is claimed twice.
    Returns ``cls``.
    """
    existing = EXPERTS_CLAIMS.get(cls)
    if existing is not None and existing != claim:
        raise ValueError(f"{cls.__qualname__} is already claimed by {existing.name!r}")
    problem = claim.gate_check(cls)
    if problem:
        raise ValueError(f"cannot claim {cls.__qualname__} for {claim.name!r}: {problem}")
    EXPERTS_CLAIMS[cls] = claim
    return cls


def claim_of(module: nn.Module) -> ExpertsClaim | None:
    """The claim on ``module``'s class, or None. Wrapper classes that torch.distributed creates around a module
    (FSDP2's ``FSDP<Class>``) are looked through; any other subclass of a claimed class is not claimed."""
    for cls in type(module).__mro__:
        claim = EXPERTS_CLAIMS.get(cls)
        if claim is not None:
            return claim
        if not cls.__module__.startswith("torch.distributed."):
            return None
    return None


def module_mismatches(module: nn.Module) -> list[str]:
    """How ``module`` differs from what veomni's kernels for it compute: its claim's contract if its class is
    claimed (`claim_experts`), else the generic `MOE_EXPERTS_CONTRACT` (`experts_mismatches`)."""
    claim = claim_of(module)
    return claim.mismatches(module) if claim is not None else experts_mismatches(module)


def is_hf_experts_module(module: nn.Module) -> bool:
    """True for instances of a class decorated with HF's ``@use_experts_implementation``."""
    return hasattr(module, "is_concatenated") and hasattr(type(module).forward, "__wrapped__")


def experts_mismatches(module: nn.Module) -> list[str]:
    """How ``module`` differs from `MOE_EXPERTS_CONTRACT`: one ``"what: expected X, found Y"`` line each.

    Besides the decorator's flags this looks at what the flags do not say: HF's own expert-parallel flag, a
    class-level ``_apply_gate`` (gpt_oss, deepseek_v4: clamps, scaled sigmoids), the activation (the kernels
    compute SiLU), clamp attributes, the weight shapes, and parameters or submodules a kernel would ignore.
    """
    found = []
    for flag, expected in MOE_EXPERTS_CONTRACT.items():
        value = getattr(module, flag, _MISSING)
        if value is not expected:
            found.append(f"{flag}: expected {expected}, found {value}")
    if getattr(module, "_is_expert_parallel", False):
        found.append(
            "_is_expert_parallel: expected False (veomni shards experts with apply_expert_plan), found True "
            "(transformers' own expert parallelism)"
        )
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not _default_apply_gate:
        owner = getattr(gate, "__qualname__", repr(gate))
        found.append(
            f"_apply_gate: expected transformers' default act_fn(gate) * up, found {owner} (a custom gate, e.g. "
            "a clamp or a scaled sigmoid)"
        )
    act = getattr(module, "act_fn", None)
    if not isinstance(act, (SiLUActivation, nn.SiLU)):
        found.append(f"act_fn: expected SiLU, found {type(act).__name__ if act is not None else 'none'}")
    for name in _CLAMP_ATTRS:
        value = getattr(module, name, None)
        if value is not None:
            found.append(f"{name}: expected none (the kernels neither clamp nor scale), found {value!r}")
    adapters = adapter_param_names(module)  # LoRA's, which the lora_* kernels take
    params = {n: p for n, p in module.named_parameters(recurse=False) if n not in adapters}
    if set(params) != {"gate_up_proj", "down_proj"}:
        found.append(
            f"parameters: expected exactly ['down_proj', 'gate_up_proj'], found {sorted(params)} (a kernel would "
            "ignore the others)"
        )
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is not None and down is not None:
        g, d = tuple(gate_up.shape), tuple(down.shape)
        if not (len(g) == 3 and len(d) == 3 and g[1] == 2 * d[2] and g[2] == d[1] and g[0] == d[0]):
            found.append(
                f"weight shapes: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], found {g} and {d}"
            )
    children = sorted(name for name, _ in module.named_children() if name != "act_fn")
    if children:
        found.append(f"submodules: expected only act_fn, found also {children} (a kernel would skip them)")
    return found


def fit_experts_backend(model: nn.Module, ops: OpsConfig) -> OpsConfig:
    """``ops`` with a ``moe_experts`` backend that implements the kernel variants ``model``'s experts use (a
    claimed class's, e.g. gpt-oss's ``clamped_*``, else ``routed``/``grouped``; ``lora_*`` for experts with LoRA
    adapters). A *defaulted* backend lacking one (the NPU default has no clamped kernels, triton no LoRA ones)
    becomes ``torch`` where that runs here and has them, else ``eager``, logged; an explicit one raises naming the
    backends that have them. ``defaulted`` is unchanged."""
    backend = ops.moe_experts
    if backend == "eager":
        return ops
    needed: set[str] = set()
    for module in model.modules():
        if is_hf_experts_module(module):
            claim = claim_of(module)
            needed |= {claim.routed, claim.grouped} if claim is not None else {"routed", "grouped"}
            if experts_adapters(module) is not None:
                needed |= {"lora_routed", "lora_grouped"}
    specs = [s for s in ops.registry.specs() if s.op == "moe_experts"]
    missing = needed - {s.variant for s in specs if s.backend == backend}
    if not missing:
        return ops
    if "moe_experts" not in ops.defaulted:
        backends = {s.backend for s in specs}
        having = sorted(b for b in backends if missing <= {s.variant for s in specs if s.backend == b})
        raise ValueError(
            f"OpsConfig.moe_experts={backend!r} has no {sorted(missing)} kernels, which this model's experts "
            f"need; backends that have them: {having}"
        )
    # LoRA experts: torch's grouped GEMMs where they run, rather than the eager loop.
    fallback = next(
        b
        for b in ("torch", "eager")
        if needed <= {s.variant for s in specs if s.backend == b}
        and ops.registry.backend_problem("moe_experts", b, ops.hardware) is None
    )
    logger.info(
        "apply_ops: moe_experts default %r lacks %s for this model; using %r",
        backend,
        sorted(missing),
        fallback,
    )
    return ops.replace(moe_experts=fallback)


def check_experts_modules(model: nn.Module, backend: str) -> int:
    """Refuse a model whose HF experts modules the ``moe_experts`` ``backend`` does not implement exactly.

    ``eager`` runs each module's own forward (any layout) and accepts everything; expert parallelism refuses it
    at run time. Every other backend computes `MOE_EXPERTS_CONTRACT`. Accepted modules are marked so the
    forward need not check again.

    Returns:
        the number of experts modules accepted.
    Raises:
        ValueError: naming each module class that differs, how (flag, expected, found), and the ways out.
    """
    experts = [(fqn, m) for fqn, m in model.named_modules() if is_hf_experts_module(m)]
    refused: dict[type, tuple[str, int, list[str]]] = {}
    for fqn, module in experts:
        problems = [] if backend == "eager" else module_mismatches(module)
        if problems:
            first, count, _ = refused.get(type(module), (fqn, 0, problems))
            refused[type(module)] = (first, count + 1, problems)
    if refused:
        parts = []
        for cls, (first, count, problems) in refused.items():
            more = f" and {count - 1} more" if count > 1 else ""
            lines = "\n".join(f"  - {p}" for p in problems)
            parts.append(f"{cls.__name__} at {first or '<root>'}{more}:\n{lines}")
        raise ValueError(
            f"OpsConfig.moe_experts={backend!r} computes HF-layout SwiGLU experts (no bias, no clamp, "
            "[E, 2I, H] / [E, H, I] weights) and the layouts claimed for veomni's own experts classes "
            f"({sorted(c.name for c in EXPERTS_CLAIMS.values())}); these experts modules differ, and running them "
            "through it would silently change the model:\n" + "\n".join(parts) + "\nUse "
            "OpsConfig(moe_experts='eager') to run the modules' own forward (no expert parallelism), or "
            "build_model(..., backend='hf')."
        )
    for _, module in experts:
        setattr(module, _CHECKED, backend)
    return len(experts)
