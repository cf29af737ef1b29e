"""The training loop as plain functions: distributed setup -> parallel state -> model -> optimizer -> data -> steps.

`train(recipe)` runs a whole job; `build_run` and `train_step` are usable on their own (tests drive them).

Loss bookkeeping per optimizer step (exact for any DP x SP x grad-accum; see `veomni.core.loss`): the step's
valid-token count ``N`` over every micro-batch and DP rank is known from the data plan. Each micro-batch's
forward gets ``num_items_in_batch = N``, so the model's loss is this rank's token-loss sum over ``N``; backward
runs on that times the world size, because FSDP averages gradients over the world (dense) and veomni's expert
units divide by the world too. The logged loss is the all-reduced sum: the exact global token mean.
MoE load balancing: the model's aux loss is per micro-batch, so it is added with weight
``coef / (grad_accum * dp)`` -- the mean over the step's micro-batches once FSDP has averaged over the world (the
model's own ``router_aux_loss_coef`` is set to 0 so that its returned loss is the pure LM loss).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from veomni.core.clip import clip_grad_norm
from veomni.core.fsdp import apply_activation_checkpointing, set_grad_sync
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import ParallelState, build_parallel_state, use_parallel_state
from veomni.kernels import Hardware, detect_hardware
from veomni.models.build import build_model, default_fsdp_policy
from veomni.models.registry import MODELS
from veomni.train.checkpoint import CheckpointManager, latest_complete
from veomni.train.data import (
    DataTopology,
    EvalData,
    Step,
    TrainData,
    build_eval_data,
    build_train_data,
    load_tokenizer,
    model_inputs,
    total_steps,
)
from veomni.train.metrics import (
    Sinks,
    StepMetrics,
    active_matmul_params,
    attention_flops,
    console_line,
    peak_flops,
    peak_memory_gib,
)
from veomni.train.optim import Schedule, build_adamw, build_scheduler
from veomni.train.recipe import Recipe, save_recipe

log = logging.getLogger("veomni.train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- distributed setup


def setup_distributed(device_pref: str) -> torch.device:
    """Initialise the default process group (torchrun's env, or a one-process group) and pick this rank's device.

    Args:
        device_pref: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.
    """
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but torch sees no CUDA device")
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        # torchrun names the GPU; a caller that initialised the group itself has already picked one.
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if use_cuda else None)
        else:
            # A single process still gets a real (one-rank) group, so that one code path serves every size.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def parallel_dims(recipe: Recipe, world_size: int) -> ParallelDims:
    """The recipe's degrees on ``world_size`` ranks (``dp_shard`` None: whatever the others leave)."""
    p = recipe.parallel
    dims = ParallelDims.for_world(world_size, dp_replicate=p.dp_replicate, sp=p.sp, ep=p.ep)
    if p.dp_shard is not None and p.dp_shard != dims.dp_shard:
        raise ValueError(
            f"parallel.dp_shard={p.dp_shard} but {world_size} ranks / (dp_replicate={p.dp_replicate} * sp={p.sp}) "
            f"= {dims.dp_shard}; leave it null or launch a matching number of ranks"
        )
    return dims


# ---------------------------------------------------------------- the run


@attrs.define
class Run:
    """Everything one training job holds."""

    recipe: Recipe
    state: ParallelState
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_data: TrainData
    eval_data: EvalData | None
    checkpoints: CheckpointManager
    total_steps: int
    aux_loss_coef: float
    flops_per_token: float
    step: int = 0


def model_config(recipe: Recipe) -> PretrainedConfig | str:
    """The recipe's model config: an inline mapping (with model_type), a path, or the weights' config."""
    config = recipe.model.config
    if isinstance(config, dict):
        values = dict(config)
        model_type = values.pop("model_type")
        return AutoConfig.for_model(model_type, **values)
    return config if config is not None else recipe.model.weights


def meta_instance(config: PretrainedConfig | str) -> nn.Module:
    """The model class veomni builds for ``config``, on the meta device (no memory): for block patterns and
    parameter counts, which the sharded model no longer shows whole."""
    loaded = MODELS.load_config(config)
    with torch.device("meta"):
        return MODELS.model_class(loaded, "causal_lm").cls._from_config(loaded)


def _fsdp_policy(recipe: Recipe, probe: nn.Module, dtype: torch.dtype, param_dtype: torch.dtype) -> Any:
    # Mixed precision only when parameters are stored above the compute dtype; gradients are reduced in fp32
    # either way (for pure bf16 too: FSDP casts them back to the parameter dtype after the reduction).
    return attrs.evolve(
        default_fsdp_policy(probe),
        activation_checkpointing=recipe.parallel.activation_checkpointing,
        reshard_after_forward=recipe.parallel.reshard_after_forward,
        param_dtype=dtype if dtype != param_dtype else None,
        reduce_dtype=torch.float32,
    )


def build_recipe_model(
    recipe: Recipe, config: PretrainedConfig | str, probe: nn.Module, ops: Any, state: ParallelState,
    device: torch.device,
) -> nn.Module:  # fmt: skip
    """The recipe's model as `build_run` builds it: FSDP2 (and EP) on ``state``'s meshes with the recipe's
    precision, or a plain module on one rank when ``model.param_dtype == model.dtype`` (nothing to shard or
    cast). ``probe`` is `meta_instance` of ``config`` (block patterns); ``ops`` a validated `OpsConfig`."""
    dtype, param_dtype = DTYPES[recipe.model.dtype], DTYPES[recipe.model.param_dtype]
    policy = _fsdp_policy(recipe, probe, dtype, param_dtype)
    if state.dims.world_size == 1 and dtype == param_dtype:
        # One rank and nothing to cast: FSDP2 would only add per-block hooks and parameter copies (42% of the
        # step time of Qwen3-1.7B on one H100, docs/benchmarks.md), so the model stays a plain module.
        log.info("one rank, %s parameters = compute dtype: training without FSDP2", recipe.model.param_dtype)
        model = build_model(config, weights=recipe.model.weights, ops=ops, dtype=param_dtype, device=device)
        if policy.activation_checkpointing:
            apply_activation_checkpointing(model, policy.block_patterns)
        return model
    return build_model(
        config,
        weights=recipe.model.weights,
        ops=ops,
        parallel_state=state,
        dtype=param_dtype,
        fsdp_policy=policy,
    )


def build_run(recipe: Recipe) -> Run:
    """Set up distributed state, model, optimizer, schedule, data and checkpoints; resume when asked."""
    device = setup_distributed(recipe.train.device)
    torch.manual_seed(recipe.train.seed)
    state = build_parallel_state(parallel_dims(recipe, dist.get_world_size()), device.type)
    tokenizer = load_tokenizer(recipe.model.tokenizer_path)
    config = model_config(recipe)
    # Kernels are validated against the device we train on (train.device=cpu on a GPU machine: CPU kernels).
    hardware = detect_hardware()
    if hardware.device_type != device.type:
        hardware = Hardware(device_type=device.type, triton_interpret=hardware.triton_interpret)
    ops = recipe.ops.to_ops_config(hardware=hardware)
    probe = meta_instance(config)
    model = build_recipe_model(recipe, config, probe, ops, state, device)
    aux_coef = float(getattr(model, "router_aux_loss_coef", 0.0) or 0.0)
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = 0.0  # the loop adds the aux term itself, scaled per micro-batch
    optimizer = build_adamw(
        model, lr=recipe.optim.lr, betas=tuple(recipe.optim.betas), eps=recipe.optim.eps,
        weight_decay=recipe.optim.weight_decay,
    )  # fmt: skip
    topology = DataTopology.from_parallel_state(state)
    # Tokenising the index is split over all ranks (each then holds the whole index).
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    train_data = build_train_data(recipe, tokenizer, topology, group=group, pin_memory=device.type == "cuda")
    eval_data = build_eval_data(recipe, tokenizer, topology, group=group, pin_memory=device.type == "cuda")
    steps = total_steps(recipe, train_data)
    schedule = Schedule(
        kind=recipe.optim.schedule, warmup_steps=recipe.optim.warmup_steps, total_steps=steps,
        min_lr_ratio=recipe.optim.min_lr_ratio,
    )  # fmt: skip
    scheduler = build_scheduler(optimizer, schedule)
    checkpoints = CheckpointManager(
        recipe.checkpoint.dir, keep_last=recipe.checkpoint.keep_last or 0,
        async_save=recipe.checkpoint.async_save, parallel_state=state,
    )  # fmt: skip
    run = Run(
        recipe=recipe, state=state, device=device, tokenizer=tokenizer, model=model, optimizer=optimizer,
        scheduler=scheduler, train_data=train_data, eval_data=eval_data, checkpoints=checkpoints,
        total_steps=steps, aux_loss_coef=aux_coef, flops_per_token=flops_per_token(probe),
    )  # fmt: skip
    _maybe_resume(run)
    return run


def flops_per_token(probe: nn.Module) -> float:
    """``6 * N_active``: matmul FLOPs per trained token (the attention term is added per step)."""
    cfg = probe.config
    experts = getattr(cfg, "num_experts", None)
    fraction = cfg.num_experts_per_tok / experts if experts else 1.0
    expert_names = [n for n, _ in probe.named_parameters() if ".experts." in n]
    return 6.0 * active_matmul_params(probe, expert_names, fraction)


def _maybe_resume(run: Run) -> None:
    resume = run.recipe.checkpoint.resume
    if resume == "never":
        return
    path = latest_complete(run.recipe.checkpoint.dir) if resume == "auto" else Path(resume)
    if path is None:
        log.info("resume=auto: no complete checkpoint under %s; starting fresh", run.recipe.checkpoint.dir)
        return
    trainer_state, rank_state = run.checkpoints.load(path, run.model, run.optimizer)
    run.scheduler.load_state_dict(trainer_state["scheduler"])
    run.step = int(trainer_state["step"])
    # The data position is global (epoch, cursor), so it resumes at any DP size; see docs/train.md.
    run.train_data.load_state_dict(trainer_state["data"])
    if trainer_state["world_size"] != dist.get_world_size():
        log.warning(
            "resumed %s saved on %d ranks on %d ranks: model and optimizer were resharded by DCP, the data "
            "position continues from the same global sample; per-rank RNG streams %s",
            path, trainer_state["world_size"], dist.get_world_size(),
            "were restored" if rank_state is not None else "start fresh on ranks that did not exist",
        )  # fmt: skip
    log.info("resumed from %s at step %d", path, run.step)


# ---------------------------------------------------------------- one step


def _forward_backward(
    run: Run, batch: dict[str, Any], num_items: torch.Tensor, grad_accum: int
) -> torch.Tensor:
    inputs = model_inputs(batch, run.device)
    labels = batch["labels"].to(run.device, non_blocking=True)
    extra = {"output_router_logits": True} if run.aux_loss_coef else {}
    with use_parallel_state(run.state):
        # No KV cache in training: HF would otherwise fill one per forward (memory), and a checkpointed layer's
        # recomputation would append its keys a second time.
        out = run.model(**inputs, shift_labels=labels, num_items_in_batch=num_items, use_cache=False, **extra)
    loss = out.loss
    objective = loss
    if run.aux_loss_coef and out.aux_loss is not None:
        # The step's aux loss is the mean over its grad_accum * dp micro-batches (an SP group's ranks each hold
        # a share of their micro-batch's value; see router_aux_loss).
        objective = objective + run.aux_loss_coef * out.aux_loss / (grad_accum * run.state.dims.dp)
    # FSDP averages gradients over the world; the objective is a sum over ranks (veomni.core.loss).
    (objective * run.state.dims.world_size).backward()
    return loss.detach()


def train_step(run: Run, step: Step) -> dict[str, float]:
    """One optimizer step over ``step.micro_batches``; returns loss, grad_norm and lr (identical on all ranks)."""
    grad_accum = len(step.micro_batches)
    num_items = torch.tensor(step.valid_tokens, device=run.device, dtype=torch.float32)
    loss_sum = torch.zeros((), device=run.device, dtype=torch.float32)
    for i, batch in enumerate(step.micro_batches):
        if isinstance(run.model, FSDPModule):
            set_grad_sync(run.model, is_last_microstep=i == grad_accum - 1)
        loss_sum += _forward_backward(run, batch, num_items, grad_accum).float()
    max_norm = run.recipe.optim.max_grad_norm
    grad_norm = clip_grad_norm(run.model, max_norm if max_norm is not None else math.inf, run.state)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum, group=run.state.loss_group)
    run.step = step.step + 1
    return {"loss": float(loss_sum), "grad_norm": float(grad_norm), "lr": lr}


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Mean token loss and perplexity over the eval data (every rank must call it)."""
    assert run.eval_data is not None
    run.model.eval()
    totals = torch.zeros(2, device=run.device, dtype=torch.float64)
    for batch in run.eval_data:
        inputs = model_inputs(batch, run.device)
        labels = batch["labels"].to(run.device)
        count = (labels != -100).sum()
        with use_parallel_state(run.state):
            out = run.model(
                **inputs,
                shift_labels=labels,
                num_items_in_batch=torch.ones((), device=run.device),
                use_cache=False,
            )
        totals += torch.stack([out.loss.double(), count.double()])
    dist.all_reduce(totals, group=run.state.loss_group)
    run.model.train()
    loss = float(totals[0] / totals[1].clamp(min=1))
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


# ---------------------------------------------------------------- the job


def _save(run: Run) -> None:
    run.checkpoints.save(
        run.step, run.model, run.optimizer,
        trainer_state={
            "step": run.step, "scheduler": run.scheduler.state_dict(), "data": run.train_data.state_dict(),
            "world_size": dist.get_world_size(), "dims": attrs.asdict(run.state.dims),
        },
        rank_state={},
    )  # fmt: skip


def _export(run: Run, name: str) -> Path:
    from veomni.models.export import export_hf

    out = Path(run.recipe.checkpoint.dir) / name
    export_hf(run.model, out, parallel_state=run.state)
    if dist.get_rank() == 0:
        run.tokenizer.save_pretrained(out)
    dist.barrier()
    return out


def train(
    recipe: Recipe, *, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> dict[str, Any]:
    """Run the job the recipe describes. Returns the per-step losses, eval results and output paths."""
    run = build_run(recipe)
    rank0 = dist.get_rank() == 0
    if rank0:
        Path(recipe.checkpoint.dir).mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, Path(recipe.checkpoint.dir) / "recipe.yaml")
        log.info(
            "training %d steps (%s); data: %s", run.total_steps, run.state.dims, run.train_data.summary()
        )
    sinks = Sinks(
        tensorboard_dir=recipe.log.tensorboard_dir if rank0 else None,
        wandb_project=recipe.log.wandb_project if rank0 else None, run_name=Path(recipe.checkpoint.dir).name,
        config={},
    )  # fmt: skip
    history: dict[str, Any] = {"loss": [], "eval": [], "exports": []}
    # One JSON line per step (appended, so a resumed run continues the same file): the run's loss curve.
    metrics_file = Path(recipe.checkpoint.dir) / "metrics.jsonl"
    peak = peak_flops(run.device)
    progress = _progress(run, rank0)
    window: list[tuple[dict[str, float], float, float, int, float]] = []
    data_iter = iter(run.train_data)
    q_width = query_width(run.model.config)
    while run.step < run.total_steps:
        t0 = time.perf_counter()
        step = next(data_iter)
        t_data = time.perf_counter() - t0
        stats = train_step(run, step)
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        elapsed = time.perf_counter() - t0
        flops = run.flops_per_token * step.tokens + attention_flops(
            _sample_lengths(step), run.model.config.num_hidden_layers, q_width
        )
        window.append((stats, elapsed, t_data, step.tokens, flops))
        history["loss"].append(stats["loss"])
        if rank0:
            _append_jsonl(
                metrics_file, {"step": run.step, **stats, "tokens": step.tokens, "seconds": elapsed}
            )
        if on_step is not None:
            on_step(run.step, stats)
        if progress is not None:
            progress.update(1)
        if run.step % recipe.train.log_interval == 0 or run.step == run.total_steps:
            _log_window(run, window, peak, sinks, progress)
            window = []
        if (
            run.eval_data is not None
            and recipe.train.eval_interval
            and run.step % recipe.train.eval_interval == 0
        ):
            result = evaluate(run)
            history["eval"].append({"step": run.step, **result})
            if rank0:
                _append_jsonl(metrics_file, {"step": run.step, **result})
            sinks.write(run.step, result)
            if rank0:
                _write(
                    progress,
                    f"eval step {run.step} | loss {result['eval_loss']:.4f} | ppl {result['eval_ppl']:.2f}",
                )
        if recipe.checkpoint.interval and run.step % recipe.checkpoint.interval == 0:
            _save(run)
        if recipe.checkpoint.hf_export_interval and run.step % recipe.checkpoint.hf_export_interval == 0:
            history["exports"].append(str(_export(run, f"hf_step_{run.step:08d}")))
    if progress is not None:
        progress.close()
    if recipe.checkpoint.save_final:
        _save(run)
    run.checkpoints.wait()
    if recipe.checkpoint.hf_export:
        history["exports"].append(str(_export(run, "hf")))
        if rank0:
            log.info("exported HF checkpoint to %s", history["exports"][-1])
    sinks.close()
    return history


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _sample_lengths(step: Step) -> list[int]:
    lengths: list[int] = []
    for batch in step.micro_batches:
        cu = batch["cu_seqlens"].tolist()
        lengths.extend(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
    return lengths


def query_width(config: PretrainedConfig) -> int:
    """Heads x head size of the attention queries (the width in the attention FLOPs term)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


def _progress(run: Run, rank0: bool):
    if not rank0:
        return None
    from tqdm import tqdm

    return tqdm(
        total=run.total_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True, leave=False
    )


def _write(progress, line: str) -> None:
    if progress is not None:
        progress.write(line)
    else:
        print(line, flush=True)


def _log_window(run: Run, window: list, peak: float | None, sinks: Sinks, progress) -> None:
    if not window:
        return
    world = run.state.dims.world_size
    seconds = sum(w[1] for w in window)
    tokens = sum(w[3] for w in window)
    flops = sum(w[4] for w in window)
    last = window[-1][0]
    metrics = StepMetrics(
        step=run.step, total_steps=run.total_steps, loss=sum(w[0]["loss"] for w in window) / len(window),
        grad_norm=last["grad_norm"], lr=last["lr"], tokens_per_s_per_device=tokens / seconds / world,
        mfu=(flops / seconds / world / peak) if peak else None, peak_memory_gib=peak_memory_gib(run.device),
        data_wait_fraction=sum(w[2] for w in window) / seconds,
    )  # fmt: skip
    if dist.get_rank() == 0:
        if run.recipe.log.console:
            _write(progress, console_line(metrics))
        values = {"loss": metrics.loss, "grad_norm": metrics.grad_norm, "lr": metrics.lr,
                  "tokens_per_s_per_device": metrics.tokens_per_s_per_device}  # fmt: skip
        if metrics.mfu is not None:
            values["mfu"] = metrics.mfu
        sinks.write(run.step, values)
