"""The training loop as plain functions: distributed setup -> parallel state -> checks -> data -> model -> steps.

`train(recipe)` runs a whole job; `build_run`, `veomni.train.step.train_step` and `veomni.train.step.evaluate`
are usable on their own (tests and benchmarks drive them). What varies by model family -- inputs, loss, FLOPs,
export -- is the run's `veomni.train.tasks.Task`; this module never looks at the model type. Everything that can
be checked without the model (data, warmup, SP head layout, vocabulary) is checked before the model is built.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from veomni.core.master_weights import MasterWeights, master_weights_of
from veomni.core.parallel_state import ParallelState, build_parallel_state
from veomni.models.families import training_hooks
from veomni.models.family import resolve
from veomni.models.lora import save_peft_adapter
from veomni.models.moe.expert_load import attach_expert_load_counters
from veomni.train.checkpoint import CheckpointManager, latest_complete
from veomni.train.checkpoint.match import config_dict
from veomni.train.checkpoint.resume import resume_path, resume_run
from veomni.train.cuda_graphs import MicroBatchGraphs
from veomni.train.data import (
    EvalData,
    TrainData,
    total_steps,
)
from veomni.train.dist_setup import parallel_dims, setup_distributed
from veomni.train.flops import flops_per_token, query_width
from veomni.train.hub import fetch_hub_sources
from veomni.train.metrics import Sinks, peak_flops
from veomni.train.model_setup import (
    build_recipe_model,
    hand_aux_loss_to_loop,
    meta_instance,
    model_config,
    one_rank_path,
)
from veomni.train.numerics import DynamicLossScale, check_finite, local_weights_finite
from veomni.train.optim import Schedule, build_adamw, build_scheduler
from veomni.train.preflight import (
    PreflightError,
    check_grad_accum,
    check_log_sinks,
    check_model_sources,
    check_resume_path,
    check_run_dir,
    check_warmup,
)
from veomni.train.profiling import StepProfiler, dump_oom_snapshot
from veomni.train.recipe import Recipe, recipe_to_dict, save_recipe
from veomni.train.run_log import (
    RunClock,
    append_jsonl,
    bad_rows,
    log_window,
    progress_bar,
    report_replaced,
    write_line,
)
from veomni.train.step import (
    check_cuda_graphs,
    evaluate,
    make_graphs,
    read_stats,
    train_step,
    train_step_on_device,
)
from veomni.train.stop_signals import StopRequests, TrainingStopped, cpu_group
from veomni.train.tasks import Task, task_class

log = logging.getLogger("veomni.train")
# Public names that moved to their own modules; kept importable from here.
__all__ = ["Run", "build_recipe_model", "build_run", "evaluate", "flops_per_token", "meta_instance",
           "model_config", "one_rank_path", "parallel_dims", "query_width", "setup_distributed", "train",
           "train_step"]  # fmt: skip


# ---------------------------------------------------------------- the run


@attrs.define
class Run:
    """Everything one training job holds (``masters``: the model's fp32 master weights on the one-rank
    master-weights path, see `one_rank_path`; None elsewhere)."""

    recipe: Recipe
    state: ParallelState
    device: torch.device
    tokenizer: PreTrainedTokenizerBase | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_data: TrainData | None
    eval_data: EvalData | None
    checkpoints: CheckpointManager | None
    total_steps: int
    task: Task
    config: PretrainedConfig | None = None
    step: int = 0
    skipped_steps: int = 0  # steps that changed nothing: no trained token, or an fp16 overflow
    overflow_steps: int = 0  # of those, fp16 overflows
    loss_scale: DynamicLossScale | None = None  # fp16 compute (veomni.train.numerics)
    resumed_from: Path | None = None
    saved_step: int | None = None  # the step whose checkpoint in checkpoint.dir holds the current state
    masters: MasterWeights | None = None
    graphs: MicroBatchGraphs | None = None  # train.cuda_graphs
    balanced_routers: list[nn.Module] = attrs.Factory(list)  # optim.moe_bias_update_speed > 0
    expert_layers: list[str] = attrs.Factory(list)  # experts modules counting their routed tokens (metrics)

    @property
    def trained(self) -> nn.Module:
        """The module whose parameters the optimizer steps, clipping reads and checkpoints hold: the fp32 master
        mirror on the one-rank master-weights path (`one_rank_path`), else the model itself."""
        return self.model if self.masters is None else self.masters.module


def balanced_routers(recipe: Recipe, config: Any, model: nn.Module) -> list[nn.Module]:
    """The routers whose auxiliary-loss-free correction bias moves after each step (``optim.moe_bias_update_speed``
    > 0), with their load counters attached by the model family's hook (`veomni.models.family.TrainingHooks`);
    [] when the speed is 0. A family without such routers, or a model with none, is a `PreflightError`."""
    speed = recipe.optim.moe_bias_update_speed
    if speed <= 0:
        return []
    hooks = training_hooks(config.model_type)
    routers = [] if hooks.balanced_routers is None else resolve(hooks.balanced_routers)(model)
    if not routers:
        raise PreflightError(
            f"optim.moe_bias_update_speed={speed} moves routers' e_score_correction_bias (auxiliary-loss-free "
            f"balancing), but {type(model).__name__} (model_type {config.model_type!r}) has no such router; set "
            "it to 0"
        )
    return routers


def build_run(recipe: Recipe) -> Run:
    """Set up distributed state, check everything checkable, build data, model, optimizer, schedule and
    checkpoints; resume when asked."""
    device = setup_distributed(recipe.train.device)
    check_resume_path(recipe.checkpoint.resume)
    check_run_dir(recipe.checkpoint.dir)
    check_log_sinks(recipe)
    recipe = fetch_hub_sources(recipe)  # Hub ids in model.weights / config / tokenizer -> cached snapshots
    check_model_sources(recipe)
    torch.manual_seed(recipe.train.seed)
    state = build_parallel_state(parallel_dims(recipe, dist.get_world_size()), device.type)
    check_grad_accum(recipe, state.dims.dp)
    if recipe.train.cuda_graphs:
        check_cuda_graphs(recipe, dist.get_world_size(), device)
    setup = task_class(recipe.model.task).prepare(recipe, state, device)
    config, probe, ops, task = setup.config, setup.probe, setup.ops, setup.task
    tokenizer, train_data, eval_data = setup.tokenizer, setup.train_data, setup.eval_data
    steps = total_steps(recipe, train_data)
    check_warmup(recipe.optim.warmup_steps, steps)

    # The initialisation depends on the seed alone, not on what building the data drew from the RNG.
    torch.manual_seed(recipe.train.seed)
    # A resume overwrites every parameter: model.weights is then not read (minutes at 100B+ scale). A LoRA
    # checkpoint holds the adapters only, so its frozen base is read from model.weights again.
    resume_from = resume_path(recipe)
    from_checkpoint = resume_from is not None and not recipe.lora.enabled
    if from_checkpoint and recipe.model.weights is not None:
        log.info("resuming from %s: model weights are taken from the checkpoint, %s is not read",
                 resume_from, recipe.model.weights)  # fmt: skip
    model = build_recipe_model(recipe, config, probe, ops, state, device, from_checkpoint=from_checkpoint)
    hand_aux_loss_to_loop(model)
    routers = balanced_routers(recipe, config, model)
    masters = master_weights_of(model)
    # On the one-rank master-weights path AdamW steps the fp32 masters (same names, so the same groups).
    optimizer = build_adamw(
        model if masters is None else masters.module, lr=recipe.optim.lr, betas=tuple(recipe.optim.betas),
        eps=recipe.optim.eps, weight_decay=recipe.optim.weight_decay, lr_multipliers=recipe.optim.lr_multipliers,
    )  # fmt: skip
    schedule = Schedule(
        kind=recipe.optim.schedule, warmup_steps=recipe.optim.warmup_steps, total_steps=steps,
        min_lr_ratio=recipe.optim.min_lr_ratio,
    )  # fmt: skip
    scheduler = build_scheduler(optimizer, schedule)
    checkpoints = CheckpointManager(
        recipe.checkpoint.dir, keep_last=recipe.checkpoint.keep_last or 0,
        async_save=recipe.checkpoint.async_save, parallel_state=state, trained_only=recipe.lora.enabled,
    )  # fmt: skip
    run = Run(
        recipe=recipe, state=state, device=device, tokenizer=tokenizer, model=model, optimizer=optimizer,
        scheduler=scheduler, train_data=train_data, eval_data=eval_data, checkpoints=checkpoints,
        total_steps=steps, task=task, config=config, masters=masters, balanced_routers=routers,
        expert_layers=attach_expert_load_counters(model),
        loss_scale=DynamicLossScale(device) if recipe.model.dtype == "float16" else None,
    )  # fmt: skip
    attach = getattr(task, "attach", None)  # models a task trains beside (dpo: its frozen reference)
    if attach is not None:
        attach(run)
    if recipe.train.cuda_graphs:
        run.graphs = make_graphs(run)
    resume_run(run, resume_from)
    if moved := checkpoints.set_aside_newer(run.step):
        log.warning(
            "%s held checkpoints above step %d, the step this run continues from (another line of training): "
            "renamed to %s so that resume=auto and keep-last pruning only see this run's",
            recipe.checkpoint.dir, run.step, [p.name for p in moved],
        )  # fmt: skip
    return run


# ---------------------------------------------------------------- the job


def _save(run: Run) -> None:
    run.checkpoints.save(
        run.step, run.trained, run.optimizer,
        trainer_state={
            "step": run.step, "scheduler": run.scheduler.state_dict(), "data": run.train_data.state_dict(),
            "world_size": dist.get_world_size(), "dims": attrs.asdict(run.state.dims),
            "skipped_steps": run.skipped_steps, "overflow_steps": run.overflow_steps,
            "loss_scale": None if run.loss_scale is None else run.loss_scale.state_dict(),
            "recipe": recipe_to_dict(run.recipe),
            "model_config": config_dict(run.config),
        },
        rank_state={},
        model_files=lambda out: run.task.checkpoint_files(run.model, out, run.tokenizer),
    )  # fmt: skip
    run.saved_step = run.step


def _export(run: Run, name: str) -> Path:
    out = Path(run.recipe.checkpoint.dir) / name
    # Exports hold the fp32 master values, as the FSDP2 path's do (not their compute-dtype rounding).
    lora = run.recipe.lora
    with run.masters.exposed() if run.masters is not None else contextlib.nullcontext():
        if not lora.enabled or lora.export in ("both", "merged"):
            run.task.export(run.model, out, run.tokenizer, run.state)
    if lora.enabled and lora.export in ("both", "adapter"):
        adapter = out.with_name(out.name + "_adapter")
        save_peft_adapter(
            run.model,
            lora.spec(),
            adapter,
            base_model_name_or_path=run.recipe.model.weights,
            parallel_state=run.state,
        )
        return adapter if lora.export == "adapter" else out
    return out


def _stop_on_signal(run: Run, signal_name: str, read_pending: Callable[[], None]) -> None:
    """Save this step (unless saved already), wait for every write, then raise `TrainingStopped`."""
    read_pending()  # the steps trained so far reach metrics.jsonl
    if run.saved_step != run.step:
        _save(run)
    run.checkpoints.wait()
    newest = latest_complete(run.recipe.checkpoint.dir)
    raise TrainingStopped(signal_name, run.step, None if newest is None else str(newest))


EVAL_FORMATS = {"eval_loss": ".4f", "eval_ppl": ".2f"}
"""How the console prints an evaluation's numbers (a task's own, dpo's rewards say, with 4 significant digits)."""


def train(
    recipe: Recipe, *, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> dict[str, Any]:
    """Run the job the recipe describes. Returns the per-step losses, eval results and output paths."""
    # Signals are caught from the start: one that comes while the model loads (a scheduler's SIGTERM during a long
    # build) stops the run before its first step, with one line, instead of killing it.
    stop = StopRequests(None) if recipe.checkpoint.save_on_signal else None
    with stop if stop is not None else contextlib.nullcontext():
        return _train(recipe, stop, on_step)


def _train(
    recipe: Recipe, stop: StopRequests | None, on_step: Callable[[int, dict[str, float]], None] | None
) -> dict[str, Any]:
    run = build_run(recipe)
    rank0 = dist.get_rank() == 0
    # One JSON line per step (appended, so a resumed run continues the same file): the run's loss curve.
    metrics_file = Path(recipe.checkpoint.dir) / "metrics.jsonl"
    if rank0:
        Path(recipe.checkpoint.dir).mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, Path(recipe.checkpoint.dir) / "recipe.yaml")
        log.info(
            "training %d steps (%s, task %s); data: %s",
            run.total_steps, run.state.dims, run.task.name, run.train_data.summary(),
        )  # fmt: skip
        if run.resumed_from is not None or metrics_file.exists():
            # Lines after this marker supersede any with a step above it (those steps are trained again); a fresh
            # start in a used directory supersedes them all (resumed_from null, step 0).
            resumed = None if run.resumed_from is None else str(run.resumed_from)
            append_jsonl(metrics_file, {"resumed_from": resumed, "step": run.step})
        if recipe.data.on_bad_row == "skip":
            append_jsonl(metrics_file, {"step": run.step, "bad_rows": bad_rows(run)})
    sinks = Sinks(
        tensorboard_dir=recipe.log.tensorboard_dir if rank0 else None,
        wandb_project=recipe.log.wandb_project if rank0 else None, run_name=Path(recipe.checkpoint.dir).name,
        config={},
    )  # fmt: skip
    history: dict[str, Any] = {"loss": [], "eval": [], "exports": [], "skipped": []}
    peak = peak_flops(run.device)
    progress = progress_bar(run, rank0)
    clock = RunClock(run.step, run.total_steps)
    # Steps run without a host sync: their loss and grad norm stay on the device until the window is read, once
    # per log interval (and before an eval, a checkpoint or the end), so the host queues the next step's work
    # while the GPU finishes this one. Window seconds are wall time between reads (each read syncs).
    pending: list[tuple[int, dict[str, Any], float, int, float]] = []
    window: list[tuple[dict[str, float], float, float, int, float, bool]] = []
    read_start = time.perf_counter()

    def read_pending() -> None:
        nonlocal pending
        if not pending:
            return
        stats_list = read_stats([p[1] for p in pending])
        per_step = (time.perf_counter() - read_start) / len(pending)
        for (number, _, t_data, tokens, flops), stats in zip(pending, stats_list, strict=True):
            skipped = bool(stats.pop("skipped"))
            reason = stats.pop("skip_reason", None)
            if not skipped and not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                if rank0:
                    append_jsonl(metrics_file, {"step": number, **stats, "diverged": True})
                run.checkpoints.wait()  # a save in flight holds a state from before this step: let it finish
                newest = latest_complete(recipe.checkpoint.dir)
                check_finite(
                    number, stats, None if newest is None else str(newest),
                    weights_finite=local_weights_finite(run.trained), last_step=run.step,
                )  # fmt: skip
            window.append((stats, per_step, t_data, tokens, flops, skipped))
            if skipped:
                history["skipped"].append(number)
            else:
                history["loss"].append(stats["loss"])
            if rank0:
                record = {"step": number, "skipped": reason} if skipped else {"step": number, **stats}
                append_jsonl(metrics_file, {**record, "tokens": tokens, "seconds": per_step})
            if on_step is not None and not skipped:
                on_step(number, stats)
        pending = []

    # Signals stop the run at a step boundary with a saved state; the ranks agree on the boundary (a CPU
    # all-reduce per step, which never waits for the GPU).
    if stop is not None:
        stop.join(cpu_group())
    profiler = StepProfiler(
        recipe.log.profile_steps, Path(recipe.checkpoint.dir) / "profile", dist.get_rank(), run.device
    )
    # The bar is closed however the loop ends, so an error is printed on a line of its own, not after the bar.
    try:
        if stop is not None and (signal_name := stop.agreed()) is not None:
            # Asked while the model was built: stop before training, with nothing new to save.
            newest = latest_complete(recipe.checkpoint.dir)
            raise TrainingStopped(signal_name, run.step, None if newest is None else str(newest))
        data_iter = iter(run.train_data)
        while run.step < run.total_steps:
            t0 = time.perf_counter()
            if not pending:
                read_start = t0  # evals and checkpoints between windows are not step time
            step = next(data_iter)
            t_data = time.perf_counter() - t0
            profiler.before_step(run.step + 1)
            try:
                stats = train_step_on_device(run, step)
            except torch.OutOfMemoryError as err:  # snapshot while the step's tensors still hold the memory
                raise dump_oom_snapshot(
                    err, run.step + 1, Path(recipe.checkpoint.dir), dist.get_rank()
                ) from None
            profiler.after_step(run.step)
            flops = 0.0 if stats["skipped"] else run.task.step_flops(step)
            pending.append((run.step, stats, t_data, step.tokens, flops))
            if progress is not None:
                progress.update(1)
            # The last step is evaluated too: the finished model is the one saved and exported, and an interval longer
            # than the run would otherwise leave the eval data unused without a word.
            evaluating = bool(
                run.eval_data is not None
                and recipe.train.eval_interval
                and (run.step % recipe.train.eval_interval == 0 or run.step == run.total_steps)
            )
            saving = bool(recipe.checkpoint.interval and run.step % recipe.checkpoint.interval == 0)
            exporting = bool(
                recipe.checkpoint.hf_export_interval and run.step % recipe.checkpoint.hf_export_interval == 0
            )
            logging_now = run.step % recipe.train.log_interval == 0 or run.step == run.total_steps
            # Evals, saves and exports are not step time: the steps before them are read (timed) first.
            if logging_now or evaluating or saving or exporting:
                read_pending()
            if logging_now:
                log_window(run, window, peak, sinks, progress, clock)
                window = []
            if evaluating:
                result = evaluate(run)
                history["eval"].append({"step": run.step, **result})
                if rank0:
                    append_jsonl(metrics_file, {"step": run.step, **result})
                sinks.write(run.step, result)
                if rank0 and recipe.log.console:
                    write_line(progress, f"eval step {run.step} | " + " | ".join(
                        f"{k.removeprefix('eval_').rsplit('/', 1)[-1]} {v:{EVAL_FORMATS.get(k, '.4g')}}"
                        for k, v in result.items()
                    ))  # fmt: skip
            if saving:
                _save(run)
            if exporting:
                history["exports"].append(str(_export(run, f"hf_step_{run.step:08d}")))
            if stop is not None and (signal_name := stop.agreed()) is not None:
                _stop_on_signal(run, signal_name, read_pending)
    finally:
        if progress is not None:
            progress.close()
    if run.skipped_steps and rank0:
        log.warning(
            "%d of %d steps were skipped (no optimizer or schedule step): %d held no trained token, %d overflowed "
            "in fp16",
            run.skipped_steps, run.total_steps, run.skipped_steps - run.overflow_steps, run.overflow_steps,
        )  # fmt: skip
    if recipe.data.on_bad_row == "skip":
        report_replaced(run, metrics_file if rank0 else None)
    # The last step may be saved already (an interval that divides the run, or a run resumed at its end).
    if recipe.checkpoint.save_final and run.saved_step != run.step:
        _save(run)
    run.checkpoints.wait()
    if recipe.checkpoint.hf_export:
        history["exports"].append(str(_export(run, "hf")))
        if rank0:
            log.info("exported HF checkpoint to %s", history["exports"][-1])
    sinks.close()
    return history
