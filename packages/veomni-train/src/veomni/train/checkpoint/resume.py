"""Resuming a training run from a checkpoint (`resume_run`, called by `veomni.train.loop.build_run`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from veomni.train.checkpoint import latest_complete, read_trainer_state, step_dir
from veomni.train.checkpoint.match import check_resumable, config_dict
from veomni.train.optim import load_scheduler_state, take_recipe_hyperparameters
from veomni.train.preflight import PreflightError
from veomni.train.recipe import Recipe, recipe_to_dict

if TYPE_CHECKING:
    from veomni.train.loop import Run

log = logging.getLogger("veomni.train")


def resume_path(recipe: Recipe) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names: None for ``never``, the newest complete one in ``checkpoint.dir``
    for ``auto`` (None, logged, when there is none), else the given step directory. `build_run` asks before it
    builds the model: a resumed run's parameters all come from the checkpoint, so ``model.weights`` is not read."""
    resume = recipe.checkpoint.resume
    if resume == "never":
        return None
    path = latest_complete(recipe.checkpoint.dir) if resume == "auto" else Path(resume)
    if path is None:
        log.info("resume=auto: no complete checkpoint under %s; starting fresh", recipe.checkpoint.dir)
    return path


def resume_run(run: Run, path: Path | None) -> None:
    """Continue ``run`` from checkpoint ``path`` (`resume_path`; None: nothing to do): check the checkpoint against
    the run, then restore model, optimizer, schedule, counters, fp16 loss scale and data position. Every rank calls
    it.

    Raises:
        CheckpointMismatchError: another model's checkpoint (`veomni.train.checkpoint.match`).
        PreflightError: a ``train.epochs`` run resumed with another step size.
    """
    if path is None:
        return
    check_resumable(
        path,
        read_trainer_state(path),
        model_config=config_dict(run.config),
        recipe=recipe_to_dict(run.recipe),
    )
    trainer_state, rank_state = run.checkpoints.load(path, run.trained, run.optimizer)
    if run.masters is not None:
        # The loaded fp32 masters, frozen ones too, into the compute model.
        run.masters.push(trainable_only=False)
    load_scheduler_state(run.scheduler, trainer_state["scheduler"])
    if (optim := run.recipe.optim).on_resume == "recipe":
        take_recipe_hyperparameters(
            run.scheduler, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
    run.step = int(trainer_state["step"])
    run.skipped_steps = int(trainer_state.get("skipped_steps", 0))
    run.overflow_steps = int(trainer_state.get("overflow_steps", 0))
    if run.loss_scale is not None:
        if (saved_scale := trainer_state.get("loss_scale")) is not None:
            run.loss_scale.load_state_dict(saved_scale)
        else:  # saved by a run without fp16 compute (a changed model.dtype is allowed on resume)
            log.warning("%s holds no fp16 loss scale: starting at %g", path, run.loss_scale.value)
    # The data position is global (epoch, cursor), so it resumes at any DP size; see docs/train.md.
    saved_data = trainer_state["data"]
    saved_per_step = saved_data["dp_size"] * saved_data["grad_accum"]
    if run.recipe.train.steps is None and saved_per_step != run.train_data.per_step:
        # train.epochs became a step count of this run's step size, applied from step 0, while run.step counts the
        # saved run's steps: the run would end before or after its last epoch.
        raise PreflightError(
            f"checkpoint {path}: train.epochs={run.recipe.train.epochs} with {run.train_data.per_step} micro-batches "
            f"per step (dp x grad_accum), but the checkpoint's run took {saved_per_step}; its step count does not "
            "carry over to the new step size. Set train.steps to the step this run should end at, or resume with "
            "the saved train.tokens_per_step / tokens_per_micro_batch"
        )
    run.train_data.load_state_dict(saved_data)
    if trainer_state["world_size"] != dist.get_world_size():
        log.warning(
            "resumed %s saved on %d ranks on %d ranks: model and optimizer were resharded by DCP, the data "
            "position continues from the same global sample; per-rank RNG streams %s",
            path, trainer_state["world_size"], dist.get_world_size(),
            "were restored" if rank_state is not None else "start fresh on ranks that did not exist",
        )  # fmt: skip
    run.resumed_from = path
    if path.resolve() == step_dir(Path(run.recipe.checkpoint.dir), run.step).resolve():
        run.saved_step = run.step
    log.info("resumed from %s at step %d", path, run.step)
