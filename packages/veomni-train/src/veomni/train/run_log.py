"""The training loop's reporting: the console / progress-bar lines, the metric windows, the JSONL records and the
bad-row reports of `veomni.train.loop.train`."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from veomni.models.moe.expert_load import load_summary, read_expert_loads
from veomni.train.metrics import Sinks, StepMetrics, console_line, window_peak_memory_gib

if TYPE_CHECKING:
    from veomni.train.loop import Run

log = logging.getLogger("veomni.train")


def bad_rows(run: Run) -> dict[str, Any]:
    """The rows the indexes left out (data.on_bad_row=skip), per file list: total and per kind."""
    out = {}
    for what, data in (("train_files", run.train_data), ("eval_files", run.eval_data)):
        if data is not None and hasattr(data, "bad_rows"):  # a stream counts the bad rows it has met
            out[what] = data.bad_rows()
        elif data is not None:
            out[what] = {"total": len(data.index.bad), "by_kind": data.index.bad.counts()}
    return out


def report_replaced(run: Run, metrics_file: Path | None) -> None:
    """Rows the workers replaced by a filler (bad only when encoded, see `veomni.train.data.loader`): each rank
    saw its own, so their union over the DP ranks is gathered (every rank calls this) and rank 0 records it."""
    mine = {what: sorted(data.replaced) for what, data in (("train_files", run.train_data),
            ("eval_files", run.eval_data)) if data is not None}  # fmt: skip
    gathered: list[dict[str, list[int]] | None] = [None] * dist.get_world_size(run.state.dp_group)
    dist.all_gather_object(gathered, mine, group=run.state.dp_group)
    union = {what: len({row for g in gathered for row in (g or {}).get(what, [])}) for what in mine}
    if metrics_file is not None:
        append_jsonl(metrics_file, {"step": run.step, "bad_rows_replaced": union})
        if any(union.values()):
            log.warning(
                "data: %s rows were bad only when encoded and were trained as pad-only fillers", union
            )


def window_source_losses(stats: list[dict[str, Any]]) -> dict[str, float]:
    """A mixture's mean loss per source over a log window's trained steps, weighted by each step's trained tokens
    of that source (`veomni.train.step.read_stats`' ``sources``); sources with no trained token are left out."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for step in stats:
        for name, numbers in step.get("sources", {}).items():
            counts.setdefault(name, 0)
            sums.setdefault(name, 0.0)
            if numbers["trained_tokens"]:
                sums[name] += numbers["loss"] * numbers["trained_tokens"]
                counts[name] += numbers["trained_tokens"]
    return {name: sums[name] / counts[name] for name in sums if counts[name]}


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float written as the string JSON readers know from JavaScript (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``): a bare ``NaN`` token is not JSON, and a diverged step must stay readable."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to the metrics file ``path`` as one strict JSON line (non-finite floats as strings)."""
    line = json.dumps(_json_safe(record), allow_nan=False)
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")


class RunClock:
    """Wall time since the loop started and the ETA of the remaining steps at the rate seen so far (evals, saves
    and exports included: they are part of what the user waits for)."""

    def __init__(self, first_step: int, total_steps: int) -> None:
        self.started = time.perf_counter()
        self.first_step = first_step
        self.total_steps = total_steps

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def eta(self, step: int) -> float | None:
        """Seconds left after ``step``, or None before the first step of this process has run."""
        done = step - self.first_step
        if done <= 0:
            return None
        return self.elapsed() / done * (self.total_steps - step)


def progress_bar(run: Run, rank0: bool):
    """A tqdm bar over the run's steps on rank 0 (starting at a resumed step) when stderr is a terminal; None
    elsewhere. Redirected to a file or a pipe, a bar's carriage-return redraws pile up into one long line (a VLM
    run left a 31 KB line of 504 redraws): there the metric lines, with elapsed time and ETA, are the progress."""
    if not rank0 or not sys.stderr.isatty():
        return None
    return _Bar(
        total=run.total_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True, leave=False
    )


class _Bar(tqdm):
    """A tqdm bar that, while drawn, writes the console's log records above itself (through `tqdm.write`): printed
    plainly, a warning would land on the end of the bar's line."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._redirect: contextlib.ExitStack | None = contextlib.ExitStack()
        self._redirect.enter_context(logging_redirect_tqdm())

    def close(self) -> None:
        if getattr(self, "_redirect", None) is not None:  # close may run again (tqdm's __del__)
            self._redirect.close()
            self._redirect = None
        super().close()


CONSOLE = logging.getLogger("veomni.train.console")  # the console lines, for `attach_log_file` only
CONSOLE.propagate = False


def write_line(progress, line: str) -> None:
    """Print ``line``, stamped with the wall-clock time as the log records are, above the progress bar (or plainly
    without one); `attach_log_file` copies it to the log file."""
    CONSOLE.info(line)
    line = f"[{time.strftime('%H:%M:%S')}] {line}"
    if progress is not None:
        progress.write(line)
    else:
        print(line, flush=True)


def attach_log_file(path: str, rank: int) -> logging.Handler:
    """Append this process's log records (INFO on rank 0, WARNING elsewhere), rank 0's console lines and the CLI's
    last line to ``path`` (its directory created). Each rank appends whole lines, so several ranks can share one
    file. Returns the handler, for `detach_log_file`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handler.setFormatter(
        logging.Formatter(
            f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"
        )
    )
    logging.getLogger().addHandler(handler)
    # The file gets what the docstring promises whatever the console's configuration (an embedding program may
    # have set the root logger to WARNING).
    logging.getLogger("veomni").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # Every rank: only rank 0 writes console lines, and another rank's last line is an error, which its level lets
    # through.
    CONSOLE.addHandler(handler)
    CONSOLE.setLevel(logging.INFO)
    return handler


def detach_log_file(handler: logging.Handler) -> None:
    """Stop copying to the file `attach_log_file` opened, and close it."""
    logging.getLogger().removeHandler(handler)
    CONSOLE.removeHandler(handler)
    handler.close()


def log_window(
    run: Run, window: list, peak: float | None, sinks: Sinks, progress, clock: RunClock | None = None
) -> None:
    """Report the steps since the last report: mean loss, throughput, MFU (with the device's ``peak`` FLOP/s),
    data-wait share and memory, to the console (rank 0) and the metric sinks. ``window`` holds one
    ``(stats, seconds, data_wait_seconds, tokens, flops, skipped)`` per step; steps without a trained token or
    with an fp16 overflow (``skipped``) count as skipped. A trained step whose loss is NaN (diverged; the trainer
    stops on it, `veomni.train.numerics`) is a trained step: its NaN reaches the line, never disguised as skipped.
    ``clock`` adds the elapsed time and the ETA to the console line."""
    trained = [w for w in window if not w[5]]
    skipped = len(window) - len(trained)
    if not trained:
        if skipped and dist.get_rank() == 0 and run.recipe.log.console:
            write_line(
                progress,
                f"step {run.step}/{run.total_steps} | skipped {skipped} (no trained token or fp16 overflow)",
            )
        return
    world = run.state.dims.world_size
    seconds = sum(w[1] for w in window)
    tokens = sum(w[3] for w in trained)
    flops = sum(w[4] for w in trained)
    last = trained[-1][0]
    metrics = StepMetrics(
        step=run.step, total_steps=run.total_steps, loss=sum(w[0]["loss"] for w in trained) / len(trained),
        grad_norm=last["grad_norm"], lr=last["lr"], tokens_per_s_per_device=tokens / seconds / world,
        mfu=(flops / seconds / world / peak) if peak else None, peak_memory_gib=window_peak_memory_gib(run.device),
        data_wait_fraction=sum(w[2] for w in window) / seconds, skipped=skipped,
        elapsed_s=None if clock is None else clock.elapsed(), eta_s=None if clock is None else clock.eta(run.step),
    )  # fmt: skip
    moe = load_summary(read_expert_loads(run.model, run.expert_layers)) if run.expert_layers else None
    if moe is not None:
        metrics = attrs.evolve(metrics, moe_imbalance=moe["moe_imbalance"])
    names = getattr(run.task, "metric_names", ())  # the task's own per-step means (dpo: rewards, log-probs)
    task_metrics = {n: sum(w[0][n] for w in trained) / len(trained) for n in names if n in trained[-1][0]}
    if task_metrics:
        shown = getattr(run.task, "console_metrics", names)
        metrics = attrs.evolve(metrics, task_metrics={n: v for n, v in task_metrics.items() if n in shown})
    sources = window_source_losses([w[0] for w in trained])
    if sources and run.recipe.log.source_losses:
        metrics = attrs.evolve(metrics, source_losses=sources)
    if dist.get_rank() == 0:
        if moe is not None:
            append_jsonl(Path(run.recipe.checkpoint.dir) / "metrics.jsonl", {"step": run.step, **moe})
        if run.recipe.log.console:
            write_line(progress, console_line(metrics))
        values = {"loss": metrics.loss, "grad_norm": metrics.grad_norm, "lr": metrics.lr,
                  "tokens_per_s_per_device": metrics.tokens_per_s_per_device}  # fmt: skip
        if metrics.mfu is not None:
            values["mfu"] = metrics.mfu
        if metrics.peak_memory_gib is not None:
            values["peak_memory_gib"] = metrics.peak_memory_gib
        if moe is not None:
            values.update({k: v for k, v in moe.items() if isinstance(v, float)})
        values.update({f"loss/{name}": loss for name, loss in sources.items()})
        values.update(task_metrics)
        sinks.write(run.step, values)
