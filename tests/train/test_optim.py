"""The learning-rate schedule and its resume: `Schedule` against its definition, and a scheduler saved with the
optimizer groups of one layout resuming on another's."""

from __future__ import annotations

import torch
import toy_models as toy
from test_checkpoint import _groups, _train_step

from veomni.train.checkpoint import CheckpointManager
from veomni.train.optim import Schedule, build_scheduler, load_scheduler_state

SCHEDULE = Schedule(kind="cosine", warmup_steps=3, total_steps=8, min_lr_ratio=0.1)


def _lrs(optimizer) -> list[tuple[float, float]]:
    return [(g["weight_decay"], g["lr"]) for g in optimizer.param_groups]


def test_a_scheduler_saved_with_more_groups_resumes_on_fewer(tmp_path):
    # An EP checkpoint resumed without EP: the saved per-group lists (base lrs, last lrs) have one entry per saved
    # group, in the saved order; the resumed schedule must follow this run's groups, as an uninterrupted run does.
    model = toy.build(0)
    optimizer = torch.optim.AdamW(_groups(model, 1e-2, 3e-2, split=True))
    scheduler = build_scheduler(optimizer, SCHEDULE)
    for step in range(2):  # mid-warmup
        _train_step(model, optimizer, step)
        scheduler.step()
    path = CheckpointManager(tmp_path).save(
        2, model, optimizer, trainer_state={"scheduler": scheduler.state_dict()}, rank_state={}
    )
    fresh = toy.build(1)
    fresh_opt = torch.optim.AdamW(_groups(fresh, 1e-2, 3e-2, split=False))
    fresh_sched = build_scheduler(fresh_opt, SCHEDULE)
    trainer_state, _ = CheckpointManager(tmp_path).load(path, fresh, fresh_opt)
    load_scheduler_state(fresh_sched, trainer_state["scheduler"])
    for step in range(2, SCHEDULE.total_steps):
        assert _lrs(fresh_opt) == [(0.1, 1e-2 * SCHEDULE.factor(step)), (0.0, 3e-2 * SCHEDULE.factor(step))]
        assert fresh_sched.get_last_lr() == [lr for _, lr in _lrs(fresh_opt)]
        _train_step(fresh, fresh_opt, step)
        _train_step(model, optimizer, step)
        fresh_sched.step()
        scheduler.step()
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_resume_with_a_longer_schedule_follows_it_from_the_first_resumed_step(tmp_path):
    # Extending a run (train.steps raised, then resumed): the schedule's shape follows the recipe (docs/train.md),
    # so the first resumed step already takes the new schedule's lr, not the one the old schedule had set.
    model = toy.build(0)
    optimizer = torch.optim.AdamW(_groups(model, 1e-2, 3e-2, split=False))
    scheduler = build_scheduler(optimizer, SCHEDULE)
    for step in range(5):  # past warmup, decaying toward total_steps=8
        _train_step(model, optimizer, step)
        scheduler.step()
    path = CheckpointManager(tmp_path).save(
        5, model, optimizer, trainer_state={"scheduler": scheduler.state_dict()}, rank_state={}
    )
    longer = Schedule(kind="cosine", warmup_steps=3, total_steps=16, min_lr_ratio=0.1)
    fresh = toy.build(1)
    fresh_opt = torch.optim.AdamW(_groups(fresh, 1e-2, 3e-2, split=False))
    fresh_sched = build_scheduler(fresh_opt, longer)
    trainer_state, _ = CheckpointManager(tmp_path).load(path, fresh, fresh_opt)
    load_scheduler_state(fresh_sched, trainer_state["scheduler"])
    for step in range(5, 8):
        assert _lrs(fresh_opt) == [(0.1, 1e-2 * longer.factor(step)), (0.0, 3e-2 * longer.factor(step))]
        assert fresh_sched.get_last_lr() == [lr for _, lr in _lrs(fresh_opt)]
        _train_step(fresh, fresh_opt, step)
        fresh_sched.step()
