"""Stopping a run cleanly on a signal: Ctrl-C, a scheduler's SIGTERM or a SIGUSR1 sent ahead of preemption.

The first signal only sets a flag; the loop asks `StopRequests.agreed` at every step boundary, the ranks agree
through one CPU all-reduce (a rank that got no signal stops with the others), and the loop saves a complete
checkpoint and raises `TrainingStopped`. The handlers are in place for the whole of `train`: a signal while the
model is built stops the run before its first step (nothing new to save), one after the last step lets the final
save and export finish. The same SIGINT or SIGTERM a second time means "now": it raises
`KeyboardInterrupt` wherever the process is (a different one does not: torchrun answers a Ctrl-C by sending its
workers SIGTERM, and that must not cut short the save the Ctrl-C asked for). A save cut short that way never gets its COMPLETE marker (`CheckpointManager` writes it
last), so `resume=auto` never picks it.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(Exception):
    """The run stopped on a signal after saving step `step` to `checkpoint` (None: nothing could be saved)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.exit_code = 128 + int(getattr(signal, signal_name))
        where = (
            f"saved {checkpoint}"
            if checkpoint is not None
            else "nothing saved (checkpoint.dir holds no state)"
        )
        super().__init__(
            f"stopped on {signal_name} after step {step}: {where}; run the same command with "
            "checkpoint.resume=auto to continue"
        )


class StopRequests:
    """Signal handlers from `install()` (or entering a `with` block) to `restore()` (main thread only; elsewhere none).

    `agreed()` is a collective when `group` spans more than one rank: every rank calls it at the same step
    boundaries. It runs on a CPU (gloo) group so it never waits for the GPU.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = group
        self._first: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopRequests:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def join(self, group: dist.ProcessGroup | None) -> None:
        """Agree over ``group`` from now on (the handlers are installed before the process group exists, so that
        a signal during the build is kept)."""
        self._group = group

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._first is None:
            self._first = signum
            name = signal.Signals(signum).name
            again = "" if signum == signal.SIGUSR1 else f"; {name} again stops at once, without saving"
            # os.write, not print: a handler may run in the middle of another write to the same stream.
            os.write(
                2, f"veomni-train: {name}: saving a checkpoint at the next step boundary{again}\n".encode()
            )
            return
        if signum == self._first and signum != signal.SIGUSR1:  # asked twice: stop now, whatever is in flight
            raise KeyboardInterrupt

    def agreed(self) -> str | None:
        """The name of the signal that stops the run (any rank's), or None to go on."""
        local = 0 if self._first is None else self._first
        if self._group is not None and dist.get_world_size(self._group) > 1:
            flag = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            local = int(flag.item())
        return None if local == 0 else signal.Signals(local).name


def cpu_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks for `StopRequests` (the default group when it is gloo already).

    Collective: every rank calls it once, at the same point. None on one process.
    """
    if dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")
