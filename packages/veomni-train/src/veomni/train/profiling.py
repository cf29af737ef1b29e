"""``log.profile_steps: [a, b]``: a torch profiler trace of steps a..b (1-based, inclusive) and a table of the
operators that took the most time, written under ``<checkpoint.dir>/profile/``.

Every rank writes its own Chrome trace (``trace_rank_R.json``: open it in https://ui.perfetto.dev or
chrome://tracing); rank 0 also writes ``top_ops.txt``, torch's ``key_averages`` table sorted by device time where
there is a device, else by CPU time. Profiling stops after step b, so the run's later steps are not slowed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("veomni.train")

TOP_OPS_ROWS = 40


class StepProfiler:
    """Call `before_step(n)` before step n is run and `after_step(n)` after it (n 1-based); a no-op outside the
    profiled window or without one."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = steps if steps is not None else (0, -1)
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self._profile: profile | None = None

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities, record_shapes=True, with_stack=False)
        self._profile.start()

    def after_step(self, step: int) -> None:
        if self._profile is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the queued kernels of the window belong in the trace
        self._profile.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace_rank_{self.rank}.json"
        self._profile.export_chrome_trace(str(trace))
        if self.rank == 0:
            sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = self._profile.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS_ROWS)
            header = f"steps {self.first}..{self.last}, sorted by {sort_by}\n"
            (self.out_dir / "top_ops.txt").write_text(header + table)
            log.info("profiled steps %d..%d: %s and %s", self.first, self.last, trace, self.out_dir / "top_ops.txt")
        self._profile = None


class TrainingOutOfMemoryError(RuntimeError):
    """A step ran out of accelerator memory; the message names the step, the rank and the snapshot written."""


def dump_oom_snapshot(err: torch.OutOfMemoryError, step: int, out_dir: Path, rank: int) -> TrainingOutOfMemoryError:
    """Write what held the memory when ``err`` was raised in step ``step``: ``oom_rank_R.pickle`` (torch's memory
    snapshot: every segment and block, with stack traces where `torch.cuda.memory._record_memory_history` was on;
    drag it into https://pytorch.org/memory_viz) and ``oom_rank_R.txt`` (``torch.cuda.memory_summary``).

    Returns the error to raise in its place (called while the failing step's tensors are still alive).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    snapshot = out_dir / f"oom_rank_{rank}.pickle"
    torch.cuda.memory._dump_snapshot(str(snapshot))
    (out_dir / f"oom_rank_{rank}.txt").write_text(torch.cuda.memory_summary())
    first_line = str(err).splitlines()[0] if str(err) else "out of memory"
    return TrainingOutOfMemoryError(
        f"step {step} ran out of memory on rank {rank} ({first_line}); memory snapshot: {snapshot} (open it at "
        "https://pytorch.org/memory_viz), summary beside it. Lower train.tokens_per_micro_batch, or turn on "
        "parallel.activation_checkpointing"
    )
