"""Shared pieces of the model-family benchmarks (`bench_families.py`, `bench_sink_attention.py`).

Timing is the median of CUDA-event-timed calls after warm-up on CUDA (``time.perf_counter`` elsewhere); peak
memory is the allocator's peak during one call minus what was allocated before it (CUDA only); errors compare
two tensors after casting both to fp32. Nothing here knows about models: callers pass closures.
"""

from __future__ import annotations

import bisect
import gc
import importlib.metadata
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

# A step slower than this is timed with fewer repetitions (eager loops and [S, S] attention: up to seconds).
SLOW_MS = 250.0


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device name, for the JSON header."""
    info: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    info["torch"] = torch.__version__
    for package in ("transformers", "triton", "liger-kernel", "kernels"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    try:
        # The imported module, not the installed distribution: a Triton put first on PYTHONPATH (fla's Hopper fix)
        # is the one that runs, while the metadata still names the image's.
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import fla

        info["fla"] = fla.__version__
    except ImportError:
        info["fla"] = None
    info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return info


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the default process group's ranks (a step ends when its slowest rank does)."""
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def release(device: torch.device) -> None:
    """Drop cached blocks between contenders so each starts from the same allocator state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median_ms(step: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``step`` after ``warmup`` calls, in milliseconds.

    CUDA: one pair of events around each call, read after a final synchronise (launch overhead included, as in a
    training step). Elsewhere: ``time.perf_counter`` per call.
    """
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measured_call(step: Callable[[], object], device: torch.device) -> tuple[object, float, float | None]:
    """Run ``step`` once: ``(its result, wall ms, peak extra MiB)``.

    Peak extra = the allocator's peak during the call minus what was allocated just before it, so inputs,
    weights and anything the caller holds are excluded, and the result's own tensors (gradients) are included.
    None off CUDA.
    """
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    result = step()
    sync(device)
    wall = (time.perf_counter() - t0) * 1e3
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return result, wall, peak


def timed_row(
    step: Callable[[], object], forward: Callable[[], object], device: torch.device, reps: int
) -> dict[str, float | None]:
    """``ms`` (median fwd+bwd), ``fwd_ms`` (median forward under no_grad), ``peak_extra_mib`` of one fwd+bwd.

    ``step`` must already have run once (compilation and first-call allocations stay out of every number).
    Steps slower than `SLOW_MS` get 1 warm-up and 3 repetitions.
    """
    _, wall, peak = measured_call(step, device)
    slow = wall > SLOW_MS
    warmup, n = (1, 3) if slow else (2, reps)
    ms = median_ms(step, device, warmup, n)
    with torch.no_grad():
        fwd_ms = median_ms(forward, device, 1, n)
    return {"ms": ms, "fwd_ms": fwd_ms, "peak_extra_mib": peak, "reps": n}


def max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` in fp32 (shapes must match)."""
    if got.shape != want.shape:
        raise ValueError(f"shape mismatch: {tuple(got.shape)} vs {tuple(want.shape)}")
    return (got.float() - want.float()).abs().max().item()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius, fp32); 0 when both are zero."""
    if got.shape != want.shape:
        raise ValueError(f"shape mismatch: {tuple(got.shape)} vs {tuple(want.shape)}")
    diff = (got.float() - want.float()).norm().item()
    norm = want.float().norm().item()
    return diff / norm if norm > 0 else diff


def worst(values: Iterable[float], default: float = 0.0) -> float:
    """The largest of ``values`` (``default`` when there are none), NaN when any of them is NaN.

    Python's ``max`` keeps a NaN only when it comes first (every comparison with NaN is false), so a contender whose
    later gradient went NaN would pass an agreement check built on it; here the NaN wins.
    """
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=default)


def error_text(err: BaseException) -> str:
    """A failure as one short line for the JSON (a failing contender is a result, not a crash)."""
    return f"{type(err).__name__}: {err}"[:400]


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Write ``result`` (indented) to ``path``; called after every row so a timeout leaves the rows so far."""
    Path(path).write_text(json.dumps(result, indent=2))


def profile_calls(
    run: Callable[[], object],
    device: torch.device,
    out_path: str | Path | None,
    *,
    steps: int = 1,
    rows: int = 40,
    sort_by: str | None = None,
) -> dict[str, float] | None:
    """Call ``run`` under torch.profiler; the top ops by device time (total, or ``sort_by``: a ``key_averages``
    column such as ``self_cuda_time_total``) go to ``out_path`` (skipped when None).

    Returns (CUDA only) ``gpu_busy_fraction``: the union of kernel intervals over the profiled wall time (1.0: the
    GPU never waited for the host), and ``profiled_step_ms``: that wall time over ``steps`` (the steps ``run``
    takes); with `mark` calls inside ``run``, also ``gpu_idle_ms_by_phase`` (`idle_by_phase`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    if out_path is not None:
        sort = sort_by or ("cuda_time_total" if device.type == "cuda" else "cpu_time_total")
        table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)
        if device.type == "cuda":  # where the host's time goes too (a host-bound step shows it here)
            table += "\n" + prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70
            )
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        Path(out_path).write_text(table)
    if device.type != "cuda":
        return None
    events = list(prof.events())
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    row: dict[str, Any] = {
        "gpu_busy_fraction": min(1.0, union_us(kernels) / wall_us),
        "profiled_step_ms": wall_us / 1e3 / steps,
    }
    marks = [(e.time_range.start, e.name[len(MARK) :]) for e in events if e.name.startswith(MARK)]
    if marks:
        row["gpu_idle_ms_by_phase"] = idle_by_phase(kernels, marks)
    return row


MARK = "mark:"


def mark(phase: str) -> None:
    """Note on the profiler's host timeline that ``phase`` starts now (a zero-length ``record_function`` named
    ``mark:<phase>``; any thread, e.g. the autograd engine's from a gradient hook). `profile_calls` then splits the
    GPU's idle time by phase."""
    with torch.profiler.record_function(MARK + phase):
        pass


def idle_by_phase(kernels: list[tuple[float, float]], marks: list[tuple[float, str]]) -> dict[str, float]:
    """GPU idle time (ms) per host phase: each gap between busy intervals of ``kernels`` (``(start, end)`` us) is
    charged to the phase the host was in when the gap ended, i.e. the last of ``marks`` (``(host us, phase)``,
    same clock) at or before the next kernel's start: the host launched that kernel late, while in that phase.
    The window starts at the first mark (``marks`` must not be empty): the gap from there to the first kernel counts,
    kernels before it and time after the last kernel do not."""
    marks = sorted(marks)
    times = [t for t, _ in marks]
    idle: dict[str, float] = {}
    busy_until = marks[0][0]
    for start, end in sorted(kernels):
        if start > busy_until:  # so start is past the first mark: bisect finds a phase
            phase = marks[bisect.bisect_right(times, start) - 1][1]
            idle[phase] = idle.get(phase, 0.0) + (start - busy_until) / 1e3
        busy_until = max(busy_until, end)
    return {k: round(v, 3) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}


def union_us(intervals: Any) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping kernels on several streams count once)."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def host_sync_sites(
    run: Callable[[], object],
    device: torch.device,
    *,
    roots: tuple[str, ...] = ("veomni", "transformers"),
    top: int = 25,
) -> dict[str, Any] | None:
    """Call ``run`` once under ``torch.cuda.set_sync_debug_mode("warn")`` and count the synchronising CUDA calls
    by the innermost stack frame under one of ``roots`` (package path fragments), so that each host sync of a step
    is traced to the line that caused it. CUDA only (None elsewhere).

    Returns ``{"host_syncs": total, "sites": [[count, "path:line function"], ...]}``, most frequent first."""
    if device.type != "cuda":
        return None
    import traceback
    import warnings
    from collections import Counter

    sites: Counter[str] = Counter()
    previous = warnings.showwarning

    def record(
        message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if "synchronizing" not in str(message):
            previous(message, category, filename, lineno, file, line)
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if any(f"/{root}/" in f.filename for root in roots)]
        frame = (ours or frames)[-1]
        where = frame.filename.split("/site-packages/")[-1].split("/src/")[-1]
        sites[f"{where}:{frame.lineno} {frame.name}"] += 1

    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
            sync(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous
    return {"host_syncs": sum(sites.values()), "sites": [[n, s] for s, n in sites.most_common(top)]}
