"""`LoraSpec`: what a LoRA run adapts and how, validated once; target resolution against a model.

A LoRA adapter adds ``scaling * B @ A`` to a frozen weight ``W`` (``A: [r, in]``, ``B: [out, r]``), so a linear
layer computes ``x @ (W + scaling * B @ A).T``. ``scaling`` is ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``), as in
PEFT, whose adapter files (`veomni.models.lora.peft_format`) this spec round-trips.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
from torch import nn

from veomni.core.fqn import fqn_matches
from veomni.models.family import LoraTargets

INITS = ("default", "gaussian", "zeros")


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"lora.{attribute.name} must be a positive number, got {value!r}")


def _names(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        # A bare string would become its letters.
        raise TypeError(f"expected a list of names or patterns, got the string {value!r}")
    return tuple(value)  # type: ignore[arg-type]


@attrs.frozen
class LoraSpec:
    """A LoRA configuration.

    Attributes:
        rank: ``r``, the inner dimension of ``B @ A``.
        alpha: the numerator of the scaling.
        dropout: dropout probability on the adapter's input (training only; 0 disables it).
        targets: what to adapt: names of the family's target groups (``attention``, ``mlp``, ``experts``, ...; see
            `veomni.models.family.LoraTargets`), module FQN globs (``model.layers.*.self_attn.q_proj``; ``*``
            stays within one name component), or bare leaf names (``q_proj``: every adaptable linear so named,
            as PEFT's ``target_modules``). Fused MoE experts (`veomni.models.lora.experts`) are selected by their
            module (``model.layers.*.mlp.experts``, or the leaf name ``experts``: both projections) or by a dotted
            glob of one projection (``model.layers.*.mlp.experts.down_proj``). Empty: the family's default groups.
        exclude: FQN globs or leaf names removed from what ``targets`` selects.
        modules_to_save: modules trained in full beside the adapters (``lm_head``, ``model.embed_tokens``):
            FQN globs or leaf names; saved whole in the adapter file, as PEFT does.
        use_rslora: scale by ``alpha / sqrt(rank)`` (rank-stabilised LoRA) instead of ``alpha / rank``.
        init: ``default`` (A Kaiming-uniform as ``nn.Linear``, B zeros: PEFT's default), ``gaussian`` (A normal
            with std ``1/rank``, B zeros: PEFT's ``gaussian``) or ``zeros`` (both zero; for tests and imports).
        init_from: a PEFT adapter directory to start from (its ``adapter_config.json`` must agree with this spec).
    """

    rank: int = attrs.field(default=16, validator=_positive)
    alpha: float = attrs.field(default=32.0, validator=_positive)
    dropout: float = 0.0
    targets: tuple[str, ...] = attrs.field(default=(), converter=_names)
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_names)
    modules_to_save: tuple[str, ...] = attrs.field(default=(), converter=_names)
    use_rslora: bool = False
    init: str = "default"
    init_from: str | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.rank, int):
            raise ValueError(f"lora.rank must be an integer, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"lora.init must be one of {INITS}, got {self.init!r}")

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _selector_matches(selector: str, fqn: str) -> bool:
    # A dotted selector is a whole-FQN glob; a bare one names the last component (PEFT's target_modules rule).
    if "." in selector:
        return fqn_matches(selector, fqn)
    return fqn_matches(selector, fqn.rsplit(".", 1)[-1])


def _projection_matches(selector: str, param: str, owner: str) -> bool:
    # A fused experts projection: a dotted glob of its own FQN, or any selector of its experts module (a bare
    # "down_proj" names linear layers, as PEFT's target_modules, not the experts' fused parameter).
    return ("." in selector and fqn_matches(selector, param)) or _selector_matches(selector, owner)


def select_modules(
    model: nn.Module,
    entries: Sequence[tuple[str, tuple[str, ...]]],
    exclude: tuple[str, ...] = (),
    *,
    what: str = "lora.targets",
    kinds: tuple[type, ...] = (nn.Linear,),
    optional: bool = False,
    experts: bool = False,
) -> list[str]:
    """FQNs of ``model``'s modules that are instances of ``kinds``, matched by an entry's selectors and by no ``exclude``
    selector, in module order. An entry is ``(label, selectors)``: a family group and its globs, or one selector
    under its own name (a dotted selector is an FQN glob, a bare one a leaf name, as PEFT's ``target_modules``).
    With ``experts``, the fused projections of MoE experts modules are candidates too, as parameter FQNs
    (``<experts>.gate_up_proj``; `veomni.models.lora.experts.expert_projections`), placed at their module.

    Raises:
        ValueError: an entry that reaches no module of ``kinds`` (unless ``optional``: then it is skipped, but not
            every entry may be empty), or ``exclude`` removing everything.
    """
    from veomni.models.lora.experts import expert_projections

    modules = [(n, m) for n, m in model.named_modules() if n]
    projections = expert_projections(model) if experts else []
    owner_of = dict(projections)
    found: list[str] = []
    for label, selectors in entries:
        hits = [n for n, m in modules if any(_selector_matches(s, n) for s in selectors)]
        usable = [n for n in hits if isinstance(model.get_submodule(n), kinds)]
        usable += [p for p, o in projections if any(_projection_matches(s, p, o) for s in selectors)]
        if not usable and not optional:
            detail = (
                f"it names {hits[:4]} (types {sorted({type(model.get_submodule(h)).__name__ for h in hits})}), "
                f"not {[k.__name__ for k in kinds]}"
                if hits
                else "it matches no module name"
            )
            sample = [n for n, m in modules if isinstance(m, kinds)][:6]
            shown = repr(label) if (label,) == selectors else f"{label!r} {list(selectors)}"
            raise ValueError(
                f"{what}: {shown} selects nothing in {type(model).__name__}: {detail}; modules it could name include "
                f"{sample} (a dotted entry is an FQN glob where * stays within one name component, a bare one a "
                "leaf name)"
            )
        found.extend(n for n in usable if n not in found)
    if not found:
        raise ValueError(
            f"{what}: {[label for label, _ in entries]} select nothing in {type(model).__name__}"
        )
    kept = [
        n
        for n in found
        if not any(
            _projection_matches(e, n, owner_of[n]) if n in owner_of else _selector_matches(e, n)
            for e in exclude
        )
    ]
    if not kept:
        raise ValueError(f"{what}: exclude {list(exclude)} removes every selected module ({found[:6]} ...)")
    order = {n: (i, 0) for i, (n, _) in enumerate(modules)}
    order.update({p: (order[o][0], j + 1) for j, (p, o) in enumerate(projections)})
    return sorted(kept, key=order.__getitem__)


def select_targets(model: nn.Module, spec: LoraSpec, declared: LoraTargets | None) -> list[str]:
    """The module FQNs ``spec`` adapts in ``model``: its targets (group names of the family's ``declared``
    `LoraTargets`, FQN globs or leaf names), or, when it names none, the family's default groups (a default group
    absent from this model's config, such as the dense MLP of an all-MoE model, is skipped); less its excludes."""
    groups = declared.groups if declared is not None else {}
    if spec.targets:
        entries = [(s, groups.get(s, (s,))) for s in spec.targets]
        return select_modules(model, entries, spec.exclude, experts=True)
    if declared is None:
        raise ValueError(
            f"lora.targets is empty and {type(model).__name__}'s family declares no LoRA target groups; name module "
            "globs or leaf names (q_proj, v_proj, ...)"
        )
    entries = [(g, groups[g]) for g in declared.default]
    return select_modules(model, entries, spec.exclude, optional=True, experts=True)
