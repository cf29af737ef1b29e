"""Checkpoint converters: HF checkpoint layouts <-> the parameters of the model, applied before EP slicing.

The protocol (`CheckpointConverter`), for the loader:

* ``can_handle(name)``: whether a checkpoint key belongs to this converter (others pass through untouched);
* ``convert(name, tensor)``: `Converted` (the model key and tensor) or `BUFFERING` (kept until its partners
  arrive, in any order);
* ``finalize()``: raises `IncompleteCheckpointError` if anything is still buffered;

and, for export, ``revert(name, tensor)``: the checkpoint keys and tensors that ``name`` is written as, or
None when ``name`` is not one of the converter's outputs.

Tensors may be real tensors or lazy ones (`veomni.models.loading.lazy`): merging lazily lets each rank read
only its own slice of the merged parameter.

The three MoE layouts, and the converters `veomni.models.convert.recipes.select_converters` chooses for them from transformers' own
conversion recipe (``transformers.conversion_mapping``; never from the model's family name):

* per-expert keys ``...mlp.experts.{e}.gate_proj.weight`` (recipe ``MergeModulelist`` [+ ``Concatenate``]):
  `ExpertMergeConverter`, which also leaves fused keys alone, so our own checkpoints load too;
* fused keys with the model's names but transposed (recipe ``Transpose``): `FusedTransposeConverter`, which
  decides by shape, passes the model's own layout through and refuses any other shape;
* fused keys in the model's layout (no recipe): no converter.
"""

from __future__ import annotations

import re
import types
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import torch

if TYPE_CHECKING:
    from veomni.models.loading.lazy import TensorLike


def _shape(tensor: TensorLike) -> tuple[int, ...]:
    return tuple(int(n) for n in tensor.shape)


def _ops() -> types.ModuleType:
    # Imported on use: the loading package imports this module, and this one needs only its tensor ops.
    from veomni.models.loading import lazy

    return lazy


class IncompleteCheckpointError(ValueError):
    """Buffered checkpoint tensors never found their partners (missing experts, gate without up, ...)."""


class UnsupportedRecipeError(NotImplementedError):
    """transformers' conversion recipe for a model uses transforms veomni's loader does not implement."""


class _Buffering:
    _instance: _Buffering | None = None

    def __new__(cls) -> _Buffering:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "BUFFERING"


BUFFERING = _Buffering()
"""What `CheckpointConverter.convert` returns when it kept the tensor to merge it later."""


@attrs.frozen
class Converted:
    """A converted tensor under its model key."""

    name: str
    tensor: TensorLike


@runtime_checkable
class CheckpointConverter(Protocol):
    """Maps checkpoint keys / layouts onto the model's parameters (see the module docstring)."""

    def can_handle(self, name: str) -> bool:
        """Whether the checkpoint key ``name`` is this converter's (others pass through unchanged)."""
        ...

    def convert(self, name: str, tensor: TensorLike) -> Converted | _Buffering:
        """The model key and tensor for ``name``, or `BUFFERING` while its partners are missing."""
        ...

    def finalize(self) -> None:
        """Raise `IncompleteCheckpointError` if anything is still buffered."""
        ...

    def revert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The checkpoint ``(key, tensor)`` pairs the model tensor ``name`` is exported as; None if not ours."""
        ...


_GLOB = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_*]+)*$")


def plain_pattern(pattern: str, what: str) -> str:
    """``pattern`` without a leading dot; raises `UnsupportedRecipeError` unless it is a plain dotted name
    (letters, digits, ``_``, ``*`` components)."""
    pattern = pattern.removeprefix(".")
    if not _GLOB.fullmatch(pattern):
        raise UnsupportedRecipeError(f"{what} pattern {pattern!r} is not a plain dotted name")
    return pattern


def suffix_regex(body: str) -> re.Pattern[str]:
    """A regex matching ``body`` (a regex) at a key's end, after a component boundary; group ``prefix``."""
    # A recipe pattern matches at a component boundary anywhere in the key ("mlp.experts.x" matches
    # "model.layers.3.mlp.experts.x"); `prefix` keeps what comes before it.
    return re.compile(r"^(?P<prefix>(?:.*\.)?)" + body + "$")


def _ranges(numbers: Sequence[int]) -> str:
    out, run = [], []
    for n in sorted(numbers):
        if run and n == run[-1] + 1:
            run.append(n)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return "[" + ", ".join(out) + "]"


class ExpertMergeConverter:
    """Per-expert keys, stacked on a new dim 0 per source pattern, then concatenated along ``concat_dim``.

    For Qwen3-MoE: ``sources=("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")``,
    ``target="mlp.experts.gate_up_proj"``, ``concat_dim=1`` turns ``E x 2`` tensors ``[I, H]`` into
    ``[E, 2I, H]`` (gate rows, then up rows); ``sources=("mlp.experts.*.down_proj.weight",)`` with
    ``target="mlp.experts.down_proj"`` stacks ``[H, I]`` into ``[E, H, I]``. Keys not matching a source
    (including the fused target itself) are not handled, so checkpoints already fused load unchanged.

    Args:
        sources: dotted patterns with exactly one ``*`` component, the expert index.
        target: the fused parameter's name, relative to the same prefix.
        num_experts: E; every source needs experts ``0 .. E-1``.
        concat_dim: dim of the stacked tensors the sources are concatenated along (used with 2+ sources).
    """

    def __init__(self, sources: Sequence[str], target: str, num_experts: int, concat_dim: int = 1) -> None:
        if isinstance(sources, str) or not sources:
            raise ValueError(
                f"ExpertMergeConverter: sources must be a non-empty sequence of patterns, got {sources!r}"
            )
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"ExpertMergeConverter: num_experts must be a positive int, got {num_experts!r}")
        self.sources = tuple(plain_pattern(s, "source") for s in sources)
        self.target = plain_pattern(target, "target")
        if "*" in self.target:
            raise UnsupportedRecipeError(f"target pattern {target!r} must name one tensor (no '*')")
        self.num_experts = num_experts
        self.concat_dim = concat_dim
        self._source_rx = []
        for s in self.sources:
            parts = s.split(".")
            if parts.count("*") != 1:
                raise UnsupportedRecipeError(f"source pattern {s!r} must have exactly one '*' component")
            body = r"\.".join(r"(?P<expert>\d+)" if p == "*" else re.escape(p) for p in parts)
            self._source_rx.append(suffix_regex(body))
        self._target_rx = suffix_regex(re.escape(self.target))
        # prefix -> per source: {expert: tensor}
        self._buffer: dict[str, list[dict[int, TensorLike]]] = {}

    def _match(self, name: str) -> tuple[str, int, int] | None:
        for i, rx in enumerate(self._source_rx):
            m = rx.match(name)
            if m:
                return m["prefix"], i, int(m["expert"])
        return None

    def can_handle(self, name: str) -> bool:
        """Whether ``name`` is one expert's tensor of a source pattern."""
        return self._match(name) is not None

    def convert(self, name: str, tensor: TensorLike) -> Converted | _Buffering:
        """Buffer one expert's tensor; return the fused tensor when the last piece of its layer arrives."""
        match = self._match(name)
        if match is None:
            raise ValueError(f"{name!r} matches none of {self.sources}; check can_handle first")
        prefix, src, expert = match
        if expert >= self.num_experts:
            raise ValueError(
                f"{name}: expert index {expert} is out of range for num_experts={self.num_experts}"
            )
        slots = self._buffer.setdefault(prefix, [{} for _ in self.sources])
        if expert in slots[src]:
            raise ValueError(f"{name}: expert {expert} of {self.sources[src]} arrived twice")
        first = next(iter(slots[src].values()), None)
        if first is not None and _shape(first) != _shape(tensor):
            raise ValueError(
                f"{name}: shape {list(_shape(tensor))} differs from the other experts' {list(_shape(first))}"
            )
        slots[src][expert] = tensor
        if any(len(s) < self.num_experts for s in slots):
            return BUFFERING
        del self._buffer[prefix]
        ops = _ops()
        stacked = [ops.stack([s[e] for e in range(self.num_experts)]) for s in slots]
        fused = stacked[0] if len(stacked) == 1 else ops.cat(stacked, self.concat_dim)
        return Converted(prefix + self.target, fused)

    def finalize(self) -> None:
        """Raise `IncompleteCheckpointError` naming every layer whose experts did not all arrive."""
        if not self._buffer:
            return
        lines = []
        for prefix, slots in sorted(self._buffer.items()):
            missing = [
                f"{self.sources[i]}: missing experts {_ranges(sorted(set(range(self.num_experts)) - set(s)))}"
                for i, s in enumerate(slots)
                if len(s) < self.num_experts
            ]
            lines.append(f"  {prefix}{self.target}: " + "; ".join(missing))
        self._buffer.clear()
        raise IncompleteCheckpointError(
            f"the checkpoint's per-expert tensors are incomplete (num_experts={self.num_experts}):\n"
            + "\n".join(lines)
        )

    def revert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Split a fused ``[E, ...]`` tensor back into per-expert keys (views; None if not a target)."""
        m = self._target_rx.match(name)
        if m is None:
            return None
        prefix = m["prefix"]
        if tensor.shape[0] != self.num_experts:
            raise ValueError(f"{name}: dim 0 is {tensor.shape[0]}, expected num_experts={self.num_experts}")
        n = len(self.sources)
        if n > 1 and tensor.shape[self.concat_dim] % n:
            raise ValueError(
                f"{name}: dim {self.concat_dim} ({tensor.shape[self.concat_dim]}) does not split into {n}"
            )
        pieces = tensor.chunk(n, dim=self.concat_dim) if n > 1 else (tensor,)
        out = []
        for source, piece in zip(self.sources, pieces, strict=True):
            for e in range(self.num_experts):
                out.append((prefix + source.replace("*", str(e)), piece[e]))
        return out


class FusedTransposeConverter:
    """Fused expert tensors stored under the model's own names but with two dims swapped.

    Dispatch is on the full shape: the model's layout passes through untouched, the transposed layout is
    transposed, and any other shape raises, as does a shape that reads the same both ways (``dim0`` and
    ``dim1`` of equal size: the layout cannot be told from the data).

    Args:
        targets: dotted names of the fused tensors, e.g. ``("mlp.experts.gate_up_proj", "mlp.experts.down_proj")``.
        expected_shapes: ``{model key: shape in the model's layout}`` (full, pre-EP); keys of the targets that
            the model does not have are not handled (the loader reports them as unexpected).
        dim0, dim1: the swapped dims.
        transpose_on_export: whether `revert` writes the transposed layout back (transformers itself keeps
            the model's layout when its recipe checks dims, so exports match its ``save_pretrained``).
    """

    def __init__(
        self,
        targets: Sequence[str],
        expected_shapes: Mapping[str, Sequence[int]],
        dim0: int = 1,
        dim1: int = 2,
        transpose_on_export: bool = False,
    ) -> None:
        if isinstance(targets, str) or not targets:
            raise ValueError(
                f"FusedTransposeConverter: targets must be a non-empty sequence, got {targets!r}"
            )
        self.targets = tuple(plain_pattern(t, "target") for t in targets)
        self._rx = [suffix_regex(re.escape(t)) for t in self.targets]
        self.dims = (dim0, dim1)
        self.transpose_on_export = transpose_on_export
        self._expected = {
            k: tuple(int(d) for d in v)
            for k, v in expected_shapes.items()
            if any(rx.match(k) for rx in self._rx)
        }

    def _swapped(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        d0, d1 = self.dims
        out = list(shape)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)

    def can_handle(self, name: str) -> bool:
        """Whether ``name`` is one of the model's fused tensors named by ``targets``."""
        return name in self._expected

    def convert(self, name: str, tensor: TensorLike) -> Converted:
        """The tensor in the model's layout: as is, or transposed; raises on any other shape."""
        ours = self._expected[name]
        theirs = self._swapped(ours)
        found = _shape(tensor)
        if ours == theirs and found == ours:
            raise ValueError(
                f"{name}: shape {list(found)} reads the same in the model's layout and the transposed one "
                f"(dims {self.dims} are equal), so the checkpoint's layout cannot be told from its shape"
            )
        if found == ours:
            return Converted(name, tensor)
        if found == theirs:
            return Converted(name, _ops().transpose(tensor, *self.dims))
        raise ValueError(
            f"{name}: checkpoint shape {list(found)} is neither the model's layout {list(ours)} nor its "
            f"transpose over dims {self.dims} {list(theirs)}"
        )

    def finalize(self) -> None:
        """Nothing is ever buffered."""

    def revert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """``[(name, tensor)]`` as HF writes it (see ``transpose_on_export``); None if not a target."""
        if name not in self._expected:
            return None
        return [(name, tensor.transpose(*self.dims).contiguous() if self.transpose_on_export else tensor)]


@runtime_checkable
class KeyTransform(Protocol):
    """A key-only transform (`veomni.models.convert.key_transforms.KeyRename`): renames checkpoint keys on load and
    model keys back on export; no tensor is touched."""

    def apply(self, key: str) -> str:
        """The checkpoint key after this transform (unchanged when it does not fire)."""
        ...

    def revert(self, key: str) -> str:
        """The checkpoint key a (renamed) model key is written as."""
        ...


def split_transforms(
    converters: Sequence[CheckpointConverter | KeyTransform],
) -> tuple[list[KeyTransform], list[CheckpointConverter]]:
    """``(key renames, tensor converters)`` of a converter list, each in its original order."""
    renames, tensor_converters = [], []
    for conv in converters:
        if isinstance(conv, CheckpointConverter):
            tensor_converters.append(conv)
        elif isinstance(conv, KeyTransform):
            renames.append(conv)
        else:
            raise TypeError(f"{conv!r} is neither a CheckpointConverter nor a KeyTransform")
    return renames, tensor_converters


def _prefix_fix(name: str, model_keys: Collection[str] | None, base: str | None) -> str:
    # transformers loads a model with a head from its base model's checkpoint and the other way round by
    # adding / dropping the base model prefix when that, and only that, names a model key.
    if model_keys is None or not base or name in model_keys:
        return name
    dot = base + "."
    if name.startswith(dot) and name[len(dot) :] in model_keys:
        return name[len(dot) :]
    return dot + name if dot + name in model_keys else name


def apply_converters(
    tensors: Mapping[str, TensorLike] | Sequence[tuple[str, TensorLike]],
    converters: Sequence[CheckpointConverter | KeyTransform],
    *,
    model_keys: Collection[str] | None = None,
    base_model_prefix: str | None = None,
) -> tuple[dict[str, TensorLike], dict[str, str]]:
    """Run checkpoint tensors through ``converters``, in transformers' order.

    Each key goes through every key rename in turn, then to the first tensor converter that can handle the
    renamed key (others pass through). Given ``model_keys``, a rename that leads away from the model while the
    original key is one of its keys is dropped, and ``base_model_prefix`` is added or removed where that names
    a model key, as ``from_pretrained`` does.

    Args:
        tensors: checkpoint ``(key, tensor)`` pairs (or a mapping), in any order.
        converters: fresh converters and key renames (converters keep state); each is finalized at the end.
        model_keys: the model's keys (enables the two rules above).
        base_model_prefix: the model's ``base_model_prefix``.
    Returns:
        ``(by model key: tensor, by model key: the checkpoint key or "<converter> (completed by <key>)")``.
    Raises:
        ValueError: two checkpoint entries produce the same model key (e.g. both per-expert and fused copies
            of one layer); whatever the converters raise (shape errors, `IncompleteCheckpointError`).
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    renames, tensor_converters = split_transforms(converters)
    if renames:
        # transformers renames keys in its natural order, and a few of its renames depend on it (GroupWeightRename).
        from transformers.core_model_loading import dot_natural_key

        items = sorted(items, key=lambda kv: dot_natural_key(kv[0]))
    out: dict[str, TensorLike] = {}
    origin: dict[str, str] = {}
    for key, tensor in items:
        renamed = key
        for rename in renames:
            renamed = rename.apply(renamed)
        conv = next((c for c in tensor_converters if c.can_handle(renamed)), None)
        if conv is None:
            if model_keys is not None and renamed not in model_keys and key in model_keys:
                renamed = key
            result: Converted | _Buffering = Converted(renamed, tensor)
            source = key
        else:
            result = conv.convert(renamed, tensor)
            if result is BUFFERING:
                continue
            source = (
                key
                if result.name == renamed
                else f"{type(getattr(conv, 'inner', conv)).__name__} (completed by {key})"
            )
        assert isinstance(result, Converted)
        name = _prefix_fix(result.name, model_keys, base_model_prefix)
        if name in out:
            raise ValueError(f"the checkpoint provides {name!r} twice: from {origin[name]} and from {source}")
        out[name] = result.tensor
        origin[name] = source
    problems = []
    for conv in tensor_converters:  # finalize all, so one error lists every incomplete layer
        try:
            conv.finalize()
        except IncompleteCheckpointError as err:
            problems.append(str(err))
    if problems:
        raise IncompleteCheckpointError("\n".join(problems))
    return out, origin
