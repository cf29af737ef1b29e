"""Per-block ``torch.compile``: each decoder block's ``forward`` compiled with ``fullgraph=True``.

Like activation checkpointing (`veomni.core.fsdp`), the block's instance ``forward`` is replaced, so every
FQN and checkpoint key stays as it was, and FSDP2's hooks (registered by a later ``fully_shard`` on the
block) run outside the compiled region, as with torchtitan's compile-then-shard order. Call it after the
kernels are bound and before `apply_fsdp2` / `apply_activation_checkpointing`: checkpointing then wraps the
compiled forward (recomputation reruns it), and ``fully_shard`` sees the blocks as they will run.

Every block of one class shares one code object, so dynamo compiles it once and the other blocks reuse that
graph (their parameters are graph inputs); blocks of different classes (a thinker's text, ViT and audio blocks)
get code objects, and dynamo caches, of their own, also when transformers wraps their ``forward`` in one shared
closure (`_own_code_forward`). One counting backend is shared by all blocks of one call, so
its count is the number of graphs dynamo built: `CompileStats`. Packed micro-batches differ in their document
count, i.e. in the length of ``cu_seq_lens_q/k`` and in ``max_length_q/k`` (an encoder tower's blocks: in their
token count and ``max_seqlen``); `PACKING_DYNAMIC_SOURCES` and dim-0 marks make those symbolic from the first
compile, so a new document or image count does not recompile.

Lazy initialisation: code inside a block may set itself up on its first call (HF attention functions resolve
their kernel then: a hardware probe building an attrs object, an ``importlib`` import), which dynamo cannot
trace. So the first call of each block also runs it once eagerly under ``torch.no_grad()`` and throws the
result away; outputs and gradients always come from the compiled graph (also when activation checkpointing
recomputes it). That costs one extra no-grad forward per block, once. It runs on a forked RNG state, so a block
with dropout draws the same masks as an eager one, and checkpointing's recomputation the forward's.

Inductor's ``comprehensive_padding`` is off for the blocks (`SAFE_INDUCTOR_OPTIONS`; an explicit ``options`` entry
wins). On torch 2.11 CUDA it made the first, static-shape graph of a dense fp32 block compute a wrong forward
(packed rows of 249 and 255 tokens: micro-batch losses 2.5e-3 relative off, the step-0 loss 6.4e-4; the dynamic
graph that a recompile then builds is exact, as is the same graph with padding or the pattern matcher off; see
pytorch/pytorch#194281 for the stale padded layout behind such faults). Padding only pads strides that are not
multiples of the alignment, i.e. odd packed lengths; the aligned shapes of real runs never took it.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import attrs
import torch
from torch import nn

from veomni.core.checkpointing import _AC_MARK, COMPILED_MARK
from veomni.core.fqn import match_blocks, pattern_tuple
from veomni.core.parallel_state import hand_state_to_compiled_region

__all__ = [
    "PACKING_DYNAMIC_SOURCES",
    "SAFE_INDUCTOR_OPTIONS",
    "CompileStats",
    "CompiledBlocks",
    "compile_blocks",
    "compile_stats",
]

# HF's packing kwargs vary from micro-batch to micro-batch: the length of ``cu_seq_lens_q/k`` (documents + 1) and
# the python ints ``max_length_q/k``. Dynamo reads this list (regexes on source names, ``:0`` = dim 0 only)
# when it first sees them, so they are symbolic from the first compile on.
PACKING_DYNAMIC_SOURCES = (
    r".*\['cu_seq_lens_[qk]'\]:0",
    r".*\['max_length_[qk]'\]",
    # An encoder tower block's longest image/item (Qwen-VL vision blocks' ``max_seqlen`` kwarg): a python int
    # that changes with the micro-batch's images (two recompiles in a 10-step VLM run before this was listed).
    r".*\['max_seqlen'\]",
)
# Inductor config every compiled block gets unless ``options`` sets the key (module docstring says why).
SAFE_INDUCTOR_OPTIONS: dict[str, Any] = {"comprehensive_padding": False}
_MARK = COMPILED_MARK
STATS_ATTR = "veomni_compile_stats"


class CompileStats:
    """The dynamo backend shared by the compiled blocks, counting what it compiles: ``graphs`` built so far (each
    a dynamo compile or recompile). ``graphs`` at the end of a run minus ``graphs`` after warm-up is the number
    of recompiles in between.

    Two of them compare equal when their backend, mode, options and ``dynamic`` are: dynamo keeps a code object's
    graphs tagged with the backend that built them and reuses one only for an equal backend, at most
    ``torch._dynamo.config.recompile_limit`` (8) graphs per code object, and with ``fullgraph=True`` one more is a
    hard error. With identity equality every `compile_blocks` call added its own graphs of the same block class,
    and the fifth model built in one process failed; with config equality a later model of the same class and
    settings reuses the graphs (its parameters are graph inputs, and dynamo's guards still check everything else
    the graph specialised on), and its ``graphs`` counts only what it compiled itself.
    """

    def __init__(
        self,
        backend: str | Callable[..., Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        dynamic: bool | None = None,
    ) -> None:
        self.backend_name = (
            backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        )
        self._kwargs: dict[str, Any] = {}
        self._inner: Callable[..., Callable[..., Any]]
        if backend == "inductor":
            # What torch.compile builds for backend="inductor": mode and options become inductor config.
            self._inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)
        else:
            self._inner = torch._dynamo.lookup_backend(backend)
            self._kwargs = {k: v for k, v in (("mode", mode), ("options", options)) if v}
        self.graphs = 0
        # A string backend by name, a callable by itself; options by value (repr: values need not be hashable).
        self._config_key = (backend, mode, repr(sorted((options or {}).items())), dynamic)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompileStats) and self._config_key == other._config_key

    def __hash__(self) -> int:
        return hash(self._config_key)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        return self._inner(gm, example_inputs, **self._kwargs)

    def __repr__(self) -> str:
        return f"CompileStats(backend={self.backend_name!r}, graphs={self.graphs})"


@attrs.frozen
class CompiledBlocks:
    """The result of `compile_blocks`: the compiled blocks' FQNs and their shared `CompileStats`."""

    fqns: tuple[str, ...]
    stats: CompileStats


def _add_dynamic_sources(entries: Sequence[str]) -> None:
    current = [e for e in torch.compiler.config.dynamic_sources.replace(" ", "").split(",") if e]
    missing = [e for e in entries if e not in current]
    if missing:
        torch.compiler.config.dynamic_sources = ",".join(current + missing)


def compile_blocks(
    model: nn.Module,
    block_patterns: Sequence[str],
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
    call_context: Callable[[bool], AbstractContextManager[Any]] | None = None,
) -> CompiledBlocks:
    """Compile the ``forward`` of every block matching ``block_patterns`` with ``fullgraph=True``, in place.

    Args:
        model: the module holding the blocks (FQNs unchanged afterwards).
        block_patterns: FQN patterns as in `veomni.core.FSDPPolicy.block_patterns` (``"model.layers.*"``).
        backend: dynamo backend (``"inductor"``; ``"aot_eager"`` traces and runs the captured graphs without
            code generation: the cheap way to prove there is no graph break).
        mode, dynamic, options: passed to ``torch.compile``; for inductor, ``options`` is laid over
            `SAFE_INDUCTOR_OPTIONS`. ``dynamic=None`` (automatic) plus the packing
            marks keeps the sequence length static and the document count dynamic.
        call_context: entered around every call of a compiled forward, as ``call_context(priming)`` --
            ``priming`` True for the eager first call whose result is thrown away, False for the compiled
            calls. It hands state that code inside the block reads from where dynamo cannot trace it (a
            ``ContextVar``) to a traceable place for the call, as this module does for the parallel state, and
            can keep the priming call from recording anything. None: no extra context.
    Returns:
        `CompiledBlocks`; its ``stats`` is also reachable through `compile_stats` (``model`` or a block).
    Raises:
        ValueError: a pattern matching nothing, nested blocks, a block already compiled, or a block whose
            forward activation checkpointing already replaced (compile first, then checkpoint).
    """
    blocks = match_blocks(model, pattern_tuple(block_patterns), [], "compile_blocks")
    for fqn in blocks:
        block = model.get_submodule(fqn)
        if getattr(block, _MARK, False):
            raise ValueError(f"compile_blocks: {fqn!r} is already compiled")
        if getattr(block, _AC_MARK, False):
            raise ValueError(
                f"compile_blocks: {fqn!r} already has a checkpointed forward; compile the blocks before "
                "activation checkpointing (it then wraps the compiled forward)"
            )
    if backend == "inductor":
        options = {**SAFE_INDUCTOR_OPTIONS, **(options or {})}
    stats = CompileStats(backend, mode, options, dynamic)
    # A process-wide torch setting, but it names only HF's packing kwargs, which must never specialise.
    _add_dynamic_sources(PACKING_DYNAMIC_SOURCES)
    for fqn in blocks:
        block = model.get_submodule(fqn)
        compiled = torch.compile(_own_code_forward(block), fullgraph=True, backend=stats, dynamic=dynamic)
        block.forward = _priming_forward(block.forward, compiled, call_context)
        object.__setattr__(block, _MARK, True)
        object.__setattr__(block, STATS_ATTR, stats)
    object.__setattr__(model, STATS_ATTR, stats)
    return CompiledBlocks(tuple(blocks), stats)


def _own_code_forward(block: nn.Module) -> Callable[..., Any]:
    """``block.forward`` to compile, on a code object of the block's own class.

    Dynamo keeps its compiled graphs per code object, at most ``torch._dynamo.config.recompile_limit`` (8) of them,
    and with ``fullgraph=True`` one more is a hard error. transformers (5.x) replaces the ``forward`` of every
    ``GradientCheckpointingLayer`` subclass with one closure, ``forward_with_checkpointing``: the text decoder
    layers, vision blocks and audio layers of a model would all share that code object, so a thinker's three block
    kinds with their dynamic recompiles filled the 8 entries, and a third model built in one process failed. With
    its checkpointing off (veomni checkpoints blocks itself: `apply_activation_checkpointing`), the wrapper only
    calls the class's own ``forward`` (``__wrapped__``), which is compiled instead: same computation, one code
    object per block class. A block with HF's checkpointing on keeps the wrapper.
    """
    bound = block.forward
    function = getattr(bound, "__func__", None)
    code = getattr(function, "__code__", None)
    if (
        function is not None
        and code is not None
        and code.co_name == "forward_with_checkpointing"
        and code.co_filename.endswith("modeling_layers.py")
        and hasattr(function, "__wrapped__")
        and not getattr(block, "gradient_checkpointing", False)
    ):
        return types.MethodType(function.__wrapped__, block)
    return bound


def _priming_forward(
    inner: Callable[..., Any],
    compiled: Callable[..., Any],
    call_context: Callable[[bool], AbstractContextManager[Any]] | None,
) -> Callable[..., Any]:
    primed = False

    def context(priming: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if call_context is None else call_context(priming)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal primed
        if not primed:
            # On a forked RNG state: activation checkpointing restores the state from before this call for its
            # recomputation, which reruns only the compiled graph; a priming run drawing dropout masks from the
            # run's stream would hand the recomputation its masks instead of the compiled forward's.
            with torch.no_grad(), _forked_rng(args, kwargs), context(True):
                inner(*args, **kwargs)
            primed = True
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            # Belt and braces for torch versions whose dynamo does not read dynamic_sources for kwargs.
            if isinstance(kwargs.get(key), torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(kwargs[key], 0)
        if isinstance(kwargs.get("cu_seqlens"), torch.Tensor):
            # An encoder tower's block (HF vision blocks take ``cu_seqlens``): its packed token count and item
            # count change with every micro-batch's images, so dim 0 of every tensor input is dynamic from the
            # first compile rather than after a recompile.
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, tuple) else (value,):
                    if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
        with hand_state_to_compiled_region(), context(False):
            return compiled(*args, **kwargs)

    return forward


def _forked_rng(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AbstractContextManager[Any]:
    """``torch.random.fork_rng`` for the CPU and the accelerator devices of the tensor inputs (the devices whose
    RNG state ``torch.utils.checkpoint`` saves)."""
    devices: dict[str, set[int]] = {}
    for value in (*args, *kwargs.values()):
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta"):
                # torch types device.index as int, but an unindexed device ("cuda") has None.
                kind, index = tensor.device.type, cast("int | None", tensor.device.index)
                if index is None:
                    index = torch.get_device_module(kind).current_device()
                devices.setdefault(kind, set()).add(index)
    stack = contextlib.ExitStack()
    # The CPU generator is forked by every fork_rng call, so once on its own when no accelerator is involved.
    for kind, indices in devices.items() or [("cuda", set())]:
        stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
    return stack


def compile_stats(module: nn.Module) -> CompileStats | None:
    """The `CompileStats` of the `compile_blocks` call that compiled ``module`` (a model or block), or None."""
    return getattr(module, STATS_ATTR, None)
