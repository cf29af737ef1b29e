"""How a built model carries its kernel set: one `Kernels` object, attached to every submodule.

Generated modeling files read ``self.veomni_kernels`` in their patched forwards; a module without one (or whose
op is configured ``eager``) runs the untouched upstream code. Attaching per instance lets two models in one
process use different kernels.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from veomni.kernels import Kernels, OpsConfig, resolve_kernels

ATTR = "veomni_kernels"
logger = logging.getLogger(__name__)


def apply_ops(model: nn.Module, ops: OpsConfig) -> Kernels:
    """Bind ``ops`` to ``model``: attach its resolved kernel set, route attention through ``ops.attention`` and,
    for MoE models, the experts through veomni's experts implementation (`veomni.models.hf.experts`).

    The attention backend is registered in HF's attention interface under `hf_attention_name` and set as the
    model's ``attn_implementation`` (packed sequences and Ulysses SP work through it). A model that is not an HF
    ``PreTrainedModel`` gets the kernels only, and an error if ``ops.attention`` was set explicitly.

    An HF experts module that the ``moe_experts`` backend does not implement exactly (a bias, a transposed or
    interleaved layout, no gate, a custom gate or activation, a clamp) is refused with a ValueError naming the
    flag, before anything is attached (`veomni.models.hf.experts.check_experts_modules`), and so is an explicitly
    chosen attention backend lacking a feature the model uses (`attention_capabilities_needed`: sinks, sliding
    windows, soft-cap), naming the backends that have it; a *defaulted* one is swapped for a capable one
    (`OpsConfig.with_capabilities`, logged).

    The config ``model`` was built from is left untouched: before the attention and experts implementations are
    set, ``model`` and its submodules get their own copy of it (`own_config`), so a second model built from or
    sharing the same config object (a frozen reference model beside the trained one) keeps its own choices.

    Returns:
        the `Kernels` now attached to every submodule.
    """
    from veomni.models.heads.seq_cls import check_loss_dispatch
    from veomni.models.hf.attention import hf_attention_name, register_hf_attention

    # A fused cross-entropy only acts through a patched forward: refused (explicit) or made eager (defaulted).
    ops = check_loss_dispatch(model, ops)
    needed = attention_capabilities_needed(model)
    if needed and getattr(model, "set_attn_implementation", None) is not None:
        adapted = ops.with_capabilities("attention", needed, _describe(model))
        if adapted.attention != ops.attention:
            logger.info(
                "apply_ops: %s needs attention %s, which the default %r lacks: using %r (set ops.attention to "
                "choose; flash_attn_4, then flex, are the fast ones on CUDA)", _describe(model), sorted(needed),
                ops.attention, adapted.attention,
            )  # fmt: skip
        ops = adapted
    experts = _has_hf_experts(model)
    if experts:
        from veomni.models.hf.experts import fit_experts_backend

        # A backend without the variants this model's experts use (gpt-oss's clamped_*): refused or eager.
        ops = fit_experts_backend(model, ops)
    resolved = resolve_kernels(ops)
    if experts:
        from veomni.models.hf.experts import check_experts_modules

        # Before anything is attached: a refused model is left as it was.
        check_experts_modules(model, resolved.config.moe_experts)
    kernels = attach_kernels(model, resolved).veomni_kernels
    set_impl = getattr(model, "set_attn_implementation", None)
    if set_impl is None:
        if "attention" not in ops.defaulted:
            raise TypeError(
                f"OpsConfig.attention={ops.attention!r} needs an HF PreTrainedModel (set_attn_implementation), "
                f"got {type(model).__name__}"
            )
        return kernels
    register_hf_attention([ops.attention])
    own_config(model)
    set_impl(hf_attention_name(ops.attention))
    _guard_sp_positions(model)
    if experts:
        from veomni.models.hf.experts import register_hf_experts

        model.set_experts_implementation(register_hf_experts())
    return kernels


def own_config(model: nn.Module) -> Any:
    """Give ``model`` a private deep copy of its HF config, swapped in wherever its submodules hold it.

    HF modules keep references to the config they were built with (``self.config`` on the model, the attention
    modules, the rotary embeddings, ...; composite models to sub-configs of it), and ``set_attn_implementation`` /
    ``set_experts_implementation`` write into those objects. Every reference in ``model.modules()`` to the config
    or to one of its sub-configs (at any depth) is replaced by the matching object of the copy, so afterwards no
    config object is shared with anything outside ``model``.

    Returns:
        the new ``model.config``.
    Raises:
        TypeError: ``model`` has no ``config`` with ``sub_configs`` (not an HF ``PreTrainedModel``).
    """
    config = getattr(model, "config", None)
    if not hasattr(config, "sub_configs"):
        raise TypeError(
            f"own_config expects an HF PreTrainedModel (a .config with sub_configs), got {type(model).__name__} "
            f"with config {type(config).__name__}"
        )
    fresh = copy.deepcopy(config)
    # id(old config or sub-config) -> its counterpart in the copy, walking both trees in step.
    swap: dict[int, Any] = {}
    pending = [(config, fresh)]
    while pending:
        old, new = pending.pop()
        swap[id(old)] = new
        for key in getattr(old, "sub_configs", {}):
            old_sub, new_sub = getattr(old, key, None), getattr(new, key, None)
            if old_sub is not None and new_sub is not None and id(old_sub) not in swap:
                pending.append((old_sub, new_sub))
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if id(value) in swap and value is not None:
                object.__setattr__(module, name, swap[id(value)])
    return fresh


_SP_POSITIONS_GUARD = "_veomni_sp_positions_guard"
# Sub-configs of models that lay out their own positions (multimodal RoPE) and check their SP inputs themselves.
_MULTIMODAL_CONFIGS = ("vision_config", "audio_config", "thinker_config")


def _guard_sp_positions(model: nn.Module) -> None:
    """Refuse, on a text model's call under Ulysses SP, inputs without ``position_ids``: HF then numbers each
    rank's slice from 0, so RoPE gets the wrong positions on every rank but the first and veomni attention reads
    the P restarts as P documents (each shard attending only to itself) -- silently wrong, with no way to tell
    HF's default positions from real ones inside the attention. Installed once per model."""
    config = getattr(model, "config", None)
    # Sequence classifiers refuse SP altogether in their forward (the pooled token lives on one rank): that error
    # names the real problem, so it is not preempted by this one.
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    if (
        getattr(model, _SP_POSITIONS_GUARD, False)
        or classifier
        or any(getattr(config, name, None) is not None for name in _MULTIMODAL_CONFIGS)
    ):
        return

    signature = inspect.signature(model.forward)

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        from veomni.models.hf.attention_inputs import current_sp_state

        if current_sp_state() is None:
            return
        # HF's forwards take position_ids as their third parameter: a positional call passes it too.
        if signature.bind_partial(*args, **kwargs).arguments.get("position_ids") is None:
            raise ValueError(
                f"{type(module).__name__} under Ulysses SP needs position_ids: each rank's slice of the row's "
                "positions (veomni.core.sp.slice_sequence of the full [B, S] positions); without them every rank "
                "numbers its shard from 0 and the attention treats the shards as separate documents"
            )

    model.register_forward_pre_hook(check, with_kwargs=True)
    object.__setattr__(model, _SP_POSITIONS_GUARD, True)


def attention_capabilities_needed(model: nn.Module) -> frozenset[str]:
    """The optional attention features (``veomni.kernels.attention.features``) ``model``'s attention calls use.

    Read from what HF's attention modules pass to the attention function: a ``sinks`` parameter (gpt-oss's
    ``s_aux``), a non-None ``sliding_window`` attribute (set per layer from ``layer_types``), and an
    ``attn_logit_softcapping`` in the config or on a module (Gemma 2's ``softcap``).
    """
    from veomni.kernels.attention.features import SINKS, SOFTCAP, WINDOW

    needed = set()
    config = getattr(model, "config", None)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        needed.add(SOFTCAP)
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), nn.Parameter):
            needed.add(SINKS)
        if getattr(module, "sliding_window", None) is not None and hasattr(module, "is_causal"):
            needed.add(WINDOW)
        if getattr(module, "attn_logit_softcapping", None) is not None and hasattr(module, "is_causal"):
            needed.add(SOFTCAP)
    return frozenset(needed)


def _describe(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{model_type} ({type(model).__name__})" if model_type else type(model).__name__


def _has_hf_experts(model: nn.Module) -> bool:
    # HF's own test: the modeling module uses @use_experts_implementation (so set_experts_implementation works).
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    return bool(can_set and can_set())


def attach_kernels(model: nn.Module, kernels: Kernels) -> nn.Module:
    """Give ``model`` and all its submodules the resolved kernel set; returns ``model``."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"attach_kernels expects veomni.kernels.Kernels, got {type(kernels).__name__}")
    for module in model.modules():
        setattr(module, ATTR, kernels)
    return model


def apply_rope(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    upstream: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    variant: str = "full",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE through ``module``'s kernel set, or the model's own ``upstream`` function when it has none / eager.

    Args:
        query: ``[B, Hq, S, D]``; key: ``[B, Hkv, S, D]``; cos, sin: ``[B, S, R]`` (HF's position embeddings).
        variant: ``"full"`` (``R == D``) or ``"partial"``: the first ``R <= D`` dims of each head rotate
            (rotate-half layout) and the rest pass through, the ``rope/partial`` kernel with ``rotary_dim = R``.
    Returns:
        the rotated ``(query, key)``, same shapes and dtype.
    """
    if variant not in ("full", "partial"):
        raise ValueError(f"apply_rope: variant must be 'full' or 'partial', got {variant!r}")
    kernels = getattr(module, ATTR, None)
    if kernels is None or kernels.config.rope == "eager":
        return upstream(query, key, cos, sin)
    if variant == "partial":
        return kernels.get("rope", "partial")(query, key, cos, sin, rotary_dim=cos.shape[-1])
    return kernels.get("rope", "full")(query, key, cos, sin)


def apply_rope_vision(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    upstream: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A vision tower's 2-D RoPE through ``module``'s kernel set (``rope_vision/full``), else ``upstream``.

    Args:
        query: ``[S, Hq, D]`` packed patch tokens; key: ``[S, Hk, D]``; cos, sin: ``[S, D]``.
    Returns:
        the rotated ``(query, key)``, same shapes and dtype.
    """
    kernels = getattr(module, ATTR, None)
    if kernels is not None and kernels.config.rope_vision != "eager":
        return kernels.get("rope_vision", "full")(query, key, cos, sin)
    return upstream(query, key, cos, sin)
