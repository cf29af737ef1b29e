"""One optimizer step and one evaluation pass, on whatever `veomni.train.tasks.Task` the run trains.

Loss bookkeeping per optimizer step (exact for any DP x SP x grad-accum; see `veomni.core.loss`): the step's
trained-token count ``N`` over every micro-batch and DP rank is known from the data plan. Each micro-batch's
forward gets ``num_items_in_batch = N``, so the model's loss is this rank's token-loss sum over ``N``; backward
runs on that times the world size, because FSDP averages gradients over the world (dense) and veomni's expert
units divide by the world too. The logged loss is the all-reduced sum: the exact global token mean.
MoE load balancing: the model's aux loss is per micro-batch, so it is added with weight
``coef / (grad_accum * dp)`` -- the mean over the step's micro-batches once FSDP has averaged over the world (the
model's own ``router_aux_loss_coef`` is set to 0 so that its returned loss is the pure LM loss). Under SP the row's
real length is stated for the forward (`veomni.core.sp.real_tokens`), so the routers' statistics skip the padding.

A step whose data holds no trained token (every label masked, possible in mixed data) has no loss to normalise:
it runs no forward, leaves the optimizer and the learning-rate schedule where they are, and is reported as
skipped. ``N`` is global, so every rank skips the same steps and no collective is left waiting. With fp16 compute
the backward runs on the loss times a dynamic scale, and a step whose gradients overflow is skipped the same way
(`veomni.train.numerics`; the gradient norm is global, so every rank decides alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from veomni.core.fsdp import set_grad_sync
from veomni.core.parallel_state import use_parallel_state
from veomni.core.sp.real_tokens import use_real_length
from veomni.models.moe.aux_free_balance import reset_load_counters, update_correction_biases
from veomni.train.cuda_graphs import MicroBatchGraphs, static_packing
from veomni.train.data import Step
from veomni.train.numerics import TrainingDivergedError
from veomni.train.optim import clip_and_step
from veomni.train.preflight import PreflightError

if TYPE_CHECKING:
    from veomni.train.loop import Run
    from veomni.train.recipe import Recipe


def _forward_backward(
    run: Run, batch: dict[str, Any], num_items: torch.Tensor, grad_accum: int
) -> torch.Tensor:
    with use_parallel_state(run.state), use_real_length(_sp_padded_row_length(batch)):
        outputs = run.task.forward(run.model, batch, run.device, num_items)
    # The step's aux loss is the mean over its grad_accum * dp micro-batches (an SP group's ranks each hold a
    # share of their micro-batch's value; see router_aux_loss).
    return _backward(run, outputs, 1.0 / (grad_accum * run.state.dims.dp))


def _sp_padded_row_length(batch: dict[str, Any]) -> int | None:
    # The real length of a row that SP padded (packing's seq_len / padded_len), so that the MoE routers' statistics
    # leave the padding out; None when nothing was padded (or the task's batches are not packed rows).
    seq_len, padded_len = batch.get("seq_len"), batch.get("padded_len")
    return seq_len if seq_len is not None and padded_len is not None and padded_len > seq_len else None


def _backward(run: Run, outputs: Any, aux_scale: float) -> torch.Tensor:
    loss, objective = run.task.loss(outputs, aux_scale)
    # FSDP averages gradients over the world; the objective is a sum over ranks (veomni.core.loss).
    objective = objective * run.state.dims.world_size
    if run.loss_scale is not None:
        objective = (
            objective * run.loss_scale.scale
        )  # fp16 (veomni.train.numerics); a tensor CUDA graphs replay
    objective.backward()
    return loss.detach()


def graphed_forward_backward(run: Run) -> Callable[[dict[str, Any], float], torch.Tensor]:
    """The micro-batch function `veomni.train.cuda_graphs.MicroBatchGraphs` captures: model kwargs (from
    ``task.model_kwargs``) and the aux-loss scale in, the detached 0-d loss out, gradients accumulated."""

    def forward_backward(kwargs: dict[str, Any], aux_scale: float) -> torch.Tensor:
        with use_parallel_state(run.state):
            outputs = run.model(**kwargs)
        return _backward(run, outputs, aux_scale)

    return forward_backward


def current_lr(run: Run) -> float:
    """The scheduled learning rate (before any per-group `lr_multipliers`)."""
    for lr, group in zip(run.scheduler.get_last_lr(), run.optimizer.param_groups, strict=True):
        if group.get("lr_multiplier", 1.0):
            return lr / group.get("lr_multiplier", 1.0)
    return 0.0  # every group has multiplier 0


def train_step(run: Run, step: Step) -> dict[str, float]:
    """One optimizer step over ``step.micro_batches``, its numbers read back to the host (`train_step_on_device`
    then `read_stats`; the trainer's loop reads them once per log window instead).

    Returns:
        ``loss``, ``grad_norm``, ``lr`` (identical on all ranks) and ``skipped`` (1.0 when the step held no trained
        token and so changed nothing; loss and grad norm are then NaN and never averaged into a log line).
    """
    return read_stats([train_step_on_device(run, step)])[0]


def read_stats(pending: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Host floats of `train_step_on_device` results: every device value of the list read in one transfer (one
    host sync for the whole list). A mixture's step gets ``sources``: per source its ``tokens``, ``trained_tokens``
    and mean ``loss`` over its trained tokens (None where the step held none of them)."""
    on_device = [v.float().reshape(-1) for s in pending for v in s.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.cat(on_device).tolist() if on_device else [])
    out = []
    for s in pending:
        stats = {k: (v if not isinstance(v, torch.Tensor) else [next(values) for _ in range(v.numel())]
                     if v.dim() else next(values)) for k, v in s.items()}  # fmt: skip
        if "source_loss" in stats:
            stats["sources"] = _source_stats(stats.pop("source_loss"), stats.pop("source_counts"))
        out.append(stats)
    return out


def _source_stats(sums: list[float], counts: tuple[tuple[str, int, int], ...]) -> dict[str, dict[str, Any]]:
    """Each source's numbers of a step: its loss sums (each over the step's global trained-token count, as every
    micro-batch's loss is) turned into its mean over its own trained tokens."""
    total = sum(trained for _, _, trained in counts)
    return {
        name: {
            "tokens": tokens,
            "trained_tokens": trained,
            "loss": value * total / trained if trained else None,
        }
        for value, (name, tokens, trained) in zip(sums, counts, strict=True)
    }


def train_step_on_device(run: Run, step: Step) -> dict[str, Any]:
    """One optimizer step over ``step.micro_batches`` without a host sync: ``loss`` and ``grad_norm`` stay 0-d
    fp32 device tensors (see `train_step` for the keys; `read_stats` reads them)."""
    run.step = step.step + 1
    if step.valid_tokens == 0:
        run.skipped_steps += 1
        return {"loss": math.nan, "grad_norm": math.nan, "lr": current_lr(run), "skipped": 1.0,
                "skip_reason": "no trained token"}  # fmt: skip
    grad_accum = len(step.micro_batches)
    # A fill kernel, not torch.tensor: a copy from pageable host memory would make the host wait for the GPU. An
    # integer: FSDP2 mixed precision and the master-weights path cast every floating forward input to the compute
    # dtype, which would round the count in bf16 and make it inf in fp16 above 65504 tokens (a zero loss).
    normaliser = getattr(run.task, "step_normaliser", None)  # a task normalising by other counts (pairs)
    if normaliser is not None:
        num_items = normaliser(step, run.device)
    else:
        num_items = torch.full((), step.valid_tokens, device=run.device, dtype=torch.int64)
    task_metrics = getattr(run.task, "step_metrics", None)  # per micro-batch shares, summed over the step
    metric_sums: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), device=run.device, dtype=torch.float32)
    # A mixture's micro-batch holds one source's rows (batch["source"]), so its loss is that source's: exact.
    per_source = (
        torch.zeros(len(step.sources), device=run.device, dtype=torch.float32) if step.sources else None
    )
    for i, batch in enumerate(step.micro_batches):
        if isinstance(run.model, FSDPModule):
            set_grad_sync(run.model, is_last_microstep=i == grad_accum - 1)
        if run.graphs is not None:
            kwargs = run.task.model_kwargs(batch, run.device, num_items)
            kwargs = static_packing(kwargs, run.recipe.train.tokens_per_micro_batch)
            micro_loss = run.graphs(kwargs, 1.0 / (grad_accum * run.state.dims.dp)).float()
        else:
            micro_loss = _forward_backward(run, batch, num_items, grad_accum).float()
        loss_sum += micro_loss
        if task_metrics is not None:
            for name, value in task_metrics().items():
                metric_sums[name] = metric_sums[name] + value if name in metric_sums else value.float()
        if per_source is not None:
            per_source[batch["source"]] += micro_loss
    lr = current_lr(run)
    # On the one-rank master-weights path the gradients are the fp32 masters' (run.trained), as FSDP2's would be.
    try:
        grad_norm, stepped = clip_and_step(
            run.optimizer, run.trained, run.recipe.optim.max_grad_norm, run.state, run.loss_scale
        )
    except TrainingDivergedError:
        # fp16 overflowing with no scale left (every rank alike: the norm is global). A save in flight holds a
        # state from before this step: let it finish, as the trainer's check of diverged numbers does.
        run.checkpoints.wait()
        raise
    if not stepped:  # an fp16 overflow: nothing of this step is applied, the next one runs at half the scale
        run.optimizer.zero_grad(set_to_none=run.graphs is None)
        if run.balanced_routers:  # the bias update counts the loads of stepped steps only
            reset_load_counters(run.balanced_routers)
        run.skipped_steps += 1
        run.overflow_steps += 1
        return {"loss": math.nan, "grad_norm": math.nan, "lr": lr, "skipped": 1.0,
                "skip_reason": f"fp16 overflow, loss scale now {run.loss_scale.value:g}"}  # fmt: skip
    if run.masters is not None:
        run.masters.push()  # the stepped fp32 masters, rounded into the compute parameters
    if run.balanced_routers:
        update_correction_biases(run.balanced_routers, run.recipe.optim.moe_bias_update_speed)
    run.scheduler.step()
    # Captured graphs accumulate into the gradient tensors they were captured with: zero them, keep them.
    run.optimizer.zero_grad(set_to_none=run.graphs is None)
    # One all-reduce for the step's loss, a mixture's per-source losses and the task's metrics.
    names = sorted(metric_sums)
    parts = [
        loss_sum.view(1),
        *([] if per_source is None else [per_source]),
        *(metric_sums[n].view(1) for n in names),
    ]
    sums = torch.cat(parts)
    dist.all_reduce(sums, group=run.state.loss_group)
    stats: dict[str, Any] = {
        "loss": sums[0],
        "grad_norm": grad_norm.detach().float(),
        "lr": lr,
        "skipped": 0.0,
    }
    if per_source is not None:
        stats |= {"source_loss": sums[1 : 1 + len(step.sources)], "source_counts": step.sources}
    stats |= dict(zip(names, sums[len(sums) - len(names) :], strict=True))
    return stats


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Mean token loss and perplexity over the eval data (every rank must call it)."""
    if run.eval_data is None:
        raise ValueError("evaluate: this run has no data.eval_files, so there is nothing to evaluate")
    task_sums = getattr(run.task, "eval_sums", None)  # a task with its own evaluation (dpo: pair metrics)
    if task_sums is not None:
        return _task_evaluate(run, task_sums)
    run.model.eval()
    loss_sum = torch.zeros((), device=run.device, dtype=torch.float64)
    tokens = 0
    one = torch.ones(
        (), device=run.device, dtype=torch.int64
    )  # each batch's loss stays a sum (Task protocol)
    for batch in run.eval_data:
        kwargs = run.task.model_kwargs(batch, run.device, one)
        kwargs.pop("output_router_logits", None)
        with use_parallel_state(run.state):
            outputs = run.model(**kwargs)
        loss_sum += outputs.loss.double()
        # Counted on the host, where the batch's labels are: a per-batch copy to the GPU would wait for it.
        tokens += int(run.task.trained_tokens(batch))
    totals = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64).to(run.device)])
    dist.all_reduce(totals, group=run.state.loss_group)
    run.model.train()
    if float(totals[1]) == 0:
        raise ValueError(
            f"evaluation: data.eval_files {list(run.recipe.data.eval_files)} hold no trained token (every label "
            "is masked), so there is no loss to report"
        )
    loss = float(totals[0] / totals[1])
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def _task_evaluate(run: Run, task_sums: Callable[..., torch.Tensor]) -> dict[str, float]:
    """`evaluate` through the task's ``eval_sums`` (per batch, this rank's share) and ``eval_results``."""
    run.model.eval()
    totals: torch.Tensor | None = None
    try:
        for batch in run.eval_data:
            with use_parallel_state(run.state):
                sums = task_sums(run.model, batch, run.device).double()
            totals = sums if totals is None else totals + sums
    finally:
        run.model.train()
    if totals is None:
        raise ValueError("evaluation: this rank got no evaluation batch")
    dist.all_reduce(totals, group=run.state.loss_group)
    return run.task.eval_results(totals)  # type: ignore[attr-defined, no-any-return]


def check_cuda_graphs(recipe: Recipe, world_size: int, device: torch.device) -> None:
    """``train.cuda_graphs`` is for one GPU, the text task and no FSDP2 (`veomni.train.cuda_graphs` says why);
    anything else is refused before the model is built."""
    problems = []
    if device.type != "cuda":
        problems.append(f"a CUDA device, found {device.type}")
    if world_size != 1:
        problems.append(f"one rank (captured graphs hold no collectives), found {world_size}")
    if recipe.parallel.force_fsdp2:
        problems.append("the one-rank path, found parallel.force_fsdp2=true")
    if recipe.model.task != "text":
        problems.append(
            f"model.task text (packed rows of one length; other tasks' input shapes vary), found {recipe.model.task}"
        )
    if problems:
        raise PreflightError("train.cuda_graphs=true needs " + "; ".join(problems))


def make_graphs(run: Run) -> MicroBatchGraphs:
    """The run's `MicroBatchGraphs`: gradients accumulate into the parameters the optimizer steps."""
    if isinstance(run.model, FSDPModule):
        raise PreflightError(
            "train.cuda_graphs=true cannot capture an FSDP2 model (per-step parameter buffers)"
        )
    return MicroBatchGraphs(graphed_forward_backward(run), list(run.trained.parameters()))
