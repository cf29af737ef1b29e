"""CUDA-graph replay of a micro-batch's forward and backward (``train.cuda_graphs: true``).

Why: at Qwen3-1.7B size a compiled step is host-bound (notebook/benchmarks-log.md, 2026-11-25 profile: ~1.5 ms of
Python per compiled block call against ~1 ms of GPU work); a captured graph launches the whole forward and
backward of a micro-batch with one call.

How: a graph replays fixed kernels over fixed addresses, so every micro-batch must have one shape and live in
one set of buffers.

* Shape. A packed row's token count, its document count (the length of ``cu_seq_lens_q/k``) and its longest
  document (``max_length_q/k``) vary. `static_packing` pads short rows to the micro-batch budget with one
  ignored document, pads the segment table with empty documents up to the next power of two and passes the
  row length as the longest document (an upper bound the varlen kernels accept), so a run needs a handful of
  graphs, one per document-count bucket.
* Buffers. The first micro-batch of each shape runs eagerly (it warms up compiled code, autotuning and lazy
  kernel set-up, none of which may happen during a capture); the second is captured into a graph whose inputs
  are static tensors, then replayed; from then on each micro-batch of that shape is copied into the inputs
  and replayed. Gradients accumulate in place into ``.grad`` tensors that must outlive the graph, so the
  optimizer zeroes them instead of freeing them (`zero_grad_keeps_buffers`).

What it does not do: collectives (FSDP2's all-gathers and reduce-scatters, Ulysses all-to-alls, EP), which
would need NCCL graph capture and fixed per-step buffers FSDP2 does not promise; the loop refuses the setting
on more than one rank. The optimizer step and clipping stay outside the graph (a handful of fused kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["MicroBatchGraphs", "document_bucket", "static_packing"]

PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")


def document_bucket(documents: int) -> int:
    """The padded document count of a row with ``documents`` documents: the next power of two (>= 1)."""
    if documents < 1:
        raise ValueError(f"a packed row holds at least one document, got {documents}")
    return 1 << (documents - 1).bit_length()


def static_packing(kwargs: dict[str, Any], row_length: int | None = None) -> dict[str, Any]:
    """``kwargs`` of a packed causal-LM forward with shape-stable packing metadata (see the module docstring).

    Args:
        kwargs: ``model(**kwargs)`` arguments with ``input_ids``, ``position_ids`` (and optionally ``labels`` /
            ``shift_labels``) ``[1, S]`` and ``cu_seq_lens_q/k`` int32 ``[n + 1]`` on the device (no host read:
            ``n`` comes from the shape).
        row_length: pad shorter rows to this many tokens (the packer's ``tokens_per_micro_batch``): the tail
            becomes one more document of token 0 at positions 0, 1, ... whose labels are ignored (-100), so it
            changes no loss and no gradient (for MoE models it does enter the router statistics).
    Returns:
        a new dict: tensors ``[1, row_length or S]``, ``cu_seq_lens_q/k`` int32 ``[b + 1]`` with
        ``b = document_bucket(documents)`` (the extra entries repeat the row length: empty documents),
        ``max_length_q/k`` = the row length; everything else unchanged.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError("train.cuda_graphs needs packed micro-batches (cu_seq_lens_q), found none")
    out = dict(kwargs)
    seq_len = kwargs["input_ids"].shape[-1]
    if row_length is not None and seq_len < row_length:
        out.update(_pad_row(kwargs, seq_len, row_length))
        cu = torch.cat([cu, cu.new_full((1,), row_length)])
        seq_len = row_length
    extra = document_bucket(cu.numel() - 1) - (cu.numel() - 1)
    padded = torch.cat([cu, cu[-1:].expand(extra)]) if extra else cu
    out.update(dict.fromkeys(PACKING_KEYS, padded))
    out.update(dict.fromkeys(MAX_LENGTH_KEYS, seq_len))
    return out


# How each [1, S] input of a packed causal-LM forward is padded: the value of the pad document's tokens.
_ROW_PADDING = {"input_ids": 0, "labels": -100, "shift_labels": -100}


def _pad_row(kwargs: dict[str, Any], seq_len: int, row_length: int) -> dict[str, torch.Tensor]:
    extra = row_length - seq_len
    out = {}
    for key, value in kwargs.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[-1] != seq_len:
            continue
        if key == "position_ids":
            tail = torch.arange(extra, device=value.device, dtype=value.dtype).unsqueeze(0)
        elif key in _ROW_PADDING:
            tail = value.new_full((1, extra), _ROW_PADDING[key])
        else:
            raise ValueError(
                f"train.cuda_graphs: cannot pad the per-token input {key!r} of a short packed row"
            )
        out[key] = torch.cat([value, tail], dim=-1)
    return out


def _signature(kwargs: dict[str, Any]) -> Hashable:
    parts = []
    for key in sorted(kwargs):
        value = kwargs[key]
        if isinstance(value, torch.Tensor):
            parts.append((key, "tensor", tuple(value.shape), value.dtype, value.device))
        else:
            parts.append((key, "value", value))
    return tuple(parts)


class _Captured:
    def __init__(self, inputs: dict[str, Any], graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.inputs, self.graph, self.output = inputs, graph, output


class MicroBatchGraphs:
    """Runs ``forward_backward(kwargs, *constants) -> 0-d loss`` eagerly once per input signature, then from
    captured graphs.

    ``forward_backward`` must be free of host syncs and of allocations that outlive it other than its returned
    loss and the ``.grad`` accumulation into ``params`` (which must already hold gradients when it is
    captured: `MicroBatchGraphs` allocates zeros for the missing ones first). Tensor inputs are copied into the
    graph's static inputs; any other kwarg and the ``constants`` are part of the signature (a new value means a
    new graph).

    Attributes:
        eager_runs, captures, replays: counts, for the benchmark JSON and tests.
    """

    def __init__(self, forward_backward: Callable[..., torch.Tensor], params: list[torch.Tensor]) -> None:
        self.forward_backward = forward_backward
        self.params = [p for p in params if p.requires_grad]
        self._seen: set[Hashable] = set()
        self._graphs: dict[Hashable, _Captured] = {}
        self.eager_runs = self.captures = self.replays = 0

    def __call__(self, kwargs: dict[str, Any], *constants: Hashable) -> torch.Tensor:
        """Run one micro-batch; returns its 0-d loss (a graph output: read or accumulate it before the next call)."""
        key = (_signature(kwargs), constants)
        if key not in self._seen:
            self._seen.add(key)
            self.eager_runs += 1
            return self.forward_backward(kwargs, *constants)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(kwargs, constants)
            return captured.output
        for name, static in captured.inputs.items():
            if isinstance(static, torch.Tensor):
                static.copy_(kwargs[name], non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return captured.output

    def _capture(self, kwargs: dict[str, Any], constants: tuple[Hashable, ...]) -> _Captured:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads_before = [p.grad for p in self.params]
        # Aliasing kept (cu_seq_lens_q is cu_seq_lens_k): compiled blocks guard on it, and a recompile inside a
        # capture would invalidate it.
        clones: dict[int, torch.Tensor] = {}
        inputs = {
            k: clones.setdefault(id(v), v.clone()) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            # thread_local: a DataLoader pin-memory thread may call CUDA while this thread captures.
            # Each graph gets its own memory pool: a pool shared between graphs lets one graph's replay write
            # where another graph's tensors live.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = self.forward_backward(inputs, *constants)
        except RuntimeError as err:
            del graph
            torch.cuda.empty_cache()  # what the failed capture held in its pool
            raise RuntimeError(
                "train.cuda_graphs: capturing the micro-batch's forward and backward failed, usually because "
                "something in it reads a device value on the host (.item(), a data-dependent shape) or "
                f"allocates through a path graphs forbid; run with train.cuda_graphs: false. Cause: {err}"
            ) from err
        replaced = [
            i for i, (p, g) in enumerate(zip(self.params, grads_before, strict=True)) if p.grad is not g
        ]
        if replaced:
            raise RuntimeError(
                f"train.cuda_graphs: the captured backward replaced {len(replaced)} gradient tensors instead of "
                "accumulating into them in place; their memory would belong to the graph and be overwritten"
            )
        self.captures += 1
        # The capture only recorded the kernels: replay them for this micro-batch.
        graph.replay()
        self.replays += 1
        return _Captured(inputs, graph, output)
