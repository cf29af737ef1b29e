"""Counting the operations that make the host wait for the device, on any device (CPU included).

On a GPU, a training step that reads a device value on the host (``.item()``, ``bool(t)``, a shape that
depends on the data such as ``nonzero``, a copy back to host memory, a blocking copy to the device) stalls the
host until the GPU has caught up, so the host can no longer queue the next kernels while the current ones run.
``torch.cuda.set_sync_debug_mode`` finds those only on a GPU; `HostSyncCounter` finds them on CPU too, by
recording every ATen call whose result the host must wait for, so CPU tests can prove a step free of them.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter"]

aten = torch.ops.aten

# Reads a device value on the host: the host waits for everything queued before it.
_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default}
# Output shapes that depend on the values: the host learns the shape from the device.
_DATA_DEPENDENT_SHAPES = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}


def _host_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # A copy between host and device memory without non_blocking waits for the device (device -> host always
    # does: the host reads the data).
    if func is aten._to_copy.default:
        src, dst = args[0].device, kwargs.get("device") or args[0].device
    elif func is aten.copy_.default:
        dst, src = args[0].device, args[1].device
    else:
        return False
    if src == dst:
        return False
    return torch.device(dst).type == "cpu" or not kwargs.get("non_blocking", False)


# torch's TorchDispatchMode.__init_subclass__ and __init__ carry no annotations.
class HostSyncCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Context manager counting host syncs by ATen op name, with the Python stack of the first one per op.

    Counted: scalar reads (``.item()``, ``bool(t)``, ``torch.equal``), data-dependent output shapes
    (``nonzero``, ``masked_select``, ``unique*``, ``bincount``, ``repeat_interleave`` without ``output_size``,
    boolean-mask indexing) and blocking copies between host and device memory. Not counted: what runs outside
    ATen (collectives, which on a GPU are queued on streams, and Python-side reads of host tensors such as a
    DataLoader's).

    Example::

        with HostSyncCounter() as syncs:
            loss = model(**batch).loss
            loss.backward()
        assert not syncs.counts, syncs.report()
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: collections.Counter[str] = collections.Counter()
        self.first_stack: dict[str, str] = {}

    def _is_sync(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if func in _SCALAR_READS or func in _DATA_DEPENDENT_SHAPES:
            return True
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func is aten.index.Tensor:
            return any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in args[1]
                if i is not None
            )
        return _host_copy(func, args, kwargs)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._is_sync(func, args, kwargs):
            name = str(func.overloadpacket.__name__)
            self.counts[name] += 1
            if name not in self.first_stack:
                self.first_stack[name] = "".join(traceback.format_stack(limit=14)[:-2])
        return func(*args, **kwargs)

    def report(self) -> str:
        """The counts and, per op, where it first happened (for assertion messages)."""
        lines = [f"host syncs: {dict(self.counts)}"]
        for name, stack in self.first_stack.items():
            lines.append(f"--- first {name}:\n{stack}")
        return "\n".join(lines)
