"""Checkpoints: exact round trip, keep-last-K and COMPLETE markers, a killed save, and resharding (FSDP2 + EP on real
gloo ranks saved, loaded by one process without any parallelism)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import toy_models as toy
from dist_harness import backend_params
from torch.distributed.tensor import DTensor

from veomni.core.fsdp import FSDPPolicy, apply_fsdp2
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.train.checkpoint import MARKER, CheckpointManager, latest_complete
from veomni.train.checkpoint.match import CheckpointMismatchError
from veomni.train.optim import build_adamw

ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train_step(model, optimizer, seed: int) -> None:
    ids, labels = toy.token_batch(seed, 2, 5)
    device = next(model.parameters()).device
    ids, labels = ids.to(device), labels.to(device)
    F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_round_trip_restores_model_optimizer_rng_and_states(tmp_path):
    model = toy.build(0, moe=True)
    optimizer = build_adamw(model, **ADAM)
    _train_step(model, optimizer, 1)
    manager = CheckpointManager(tmp_path, keep_last=2)
    torch.manual_seed(123)
    manager.save(1, model, optimizer, trainer_state={"step": 1}, rank_state={"data": {"cursor": 7}})
    expected_draw = torch.rand(3)

    _train_step(model, optimizer, 2)  # diverge, then come back
    want_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    fresh = toy.build(99, moe=True)
    fresh_opt = build_adamw(fresh, **ADAM)
    trainer_state, rank_state = manager.load(latest_complete(tmp_path), fresh, fresh_opt)
    assert trainer_state == {"step": 1} and rank_state == {"data": {"cursor": 7}}
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG is where it was at save time
    _train_step(fresh, fresh_opt, 2)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, want_params[name]), name


def test_a_resave_killed_between_its_renames_resumes_from_the_new_copy(tmp_path):
    model = toy.build(0)
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, model, optimizer, trainer_state={"step": step}, rank_state={})
    # The re-save of step 2 wrote and marked step_2.new, renamed step_2 to step_2.old, and died there.
    shutil.copytree(tmp_path / "step_00000002", tmp_path / "step_00000002.new")
    (tmp_path / "step_00000002").rename(tmp_path / "step_00000002.old")
    latest = latest_complete(tmp_path)
    assert latest.name == "step_00000002.new"  # not step 1: the newest complete state is kept
    fresh = toy.build(1)
    trainer_state, _ = manager.load(latest, fresh, build_adamw(fresh, **ADAM))
    assert trainer_state["step"] == 2
    manager.save(3, model, optimizer, trainer_state={"step": 3}, rank_state={})
    # The next save finishes the swap: step 2 is kept (keep_last 0 keeps every checkpoint), the copies are gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]
    assert torch.load(tmp_path / "step_00000002" / "trainer.pt")["step"] == 2


def test_a_complete_new_copy_beside_its_step_is_the_newer_state(tmp_path):
    # Killed after the new copy's marker and before the first rename: both are complete, the copy is newer.
    model = toy.build(0)
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(2, model, optimizer, trainer_state={"step": 2, "run": "old"}, rank_state={})
    shutil.copytree(tmp_path / "step_00000002", tmp_path / "step_00000002.new")
    torch.save({"step": 2, "run": "new"}, tmp_path / "step_00000002.new" / "trainer.pt")
    assert latest_complete(tmp_path).name == "step_00000002.new"
    manager.save(3, model, optimizer, trainer_state={"step": 3}, rank_state={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]  # keep_last 1, nothing staged left


def test_keep_last_prunes_old_and_incomplete(tmp_path):
    model = toy.build(0)
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(tmp_path, keep_last=2)
    (tmp_path / "step_00000000").mkdir(parents=True)  # an interrupted save from an earlier run
    for step in (1, 2, 3):
        manager.save(step, model, optimizer, trainer_state={"step": step}, rank_state={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    assert latest_complete(tmp_path).name == "step_00000003"
    (tmp_path / "step_00000003" / MARKER).unlink()
    assert latest_complete(tmp_path).name == "step_00000002"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.load(tmp_path / "step_00000003", model, optimizer)
    with pytest.raises(
        FileNotFoundError,
        match=f"pass one of its step directories, e.g. the newest, {tmp_path}/step_00000002",
    ):
        manager.load(tmp_path, model, optimizer)  # the run's directory where a step's is meant
    with pytest.raises(ValueError, match="keep_last must be >= 0"):
        CheckpointManager(tmp_path, keep_last=-1)


def test_async_save_marks_complete_after_the_write(tmp_path):
    model = toy.build(0)
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(tmp_path, async_save=True)
    path = manager.save(5, model, optimizer, trainer_state={"step": 5}, rank_state={})
    manager.wait()
    assert (path / MARKER).is_file()
    fresh = toy.build(1)
    manager.load(path, fresh, build_adamw(fresh, **ADAM))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))


_SAVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from veomni.train.checkpoint import CheckpointManager
    from veomni.train.optim import build_adamw
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])  # ~50 MB: a save takes a while
    optimizer = build_adamw(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    manager = CheckpointManager(sys.argv[1])
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        manager.save(step, model, optimizer, trainer_state={"step": step}, rank_state={})
        print(step, flush=True)
    """
)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # step 1 is complete
        deadline = time.monotonic() + 60
        while not (tmp_path / "step_00000002" / "dcp").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)  # mid-save of step 2 (or just after, if it was quick)
    finally:
        proc.kill()
        proc.wait()
    latest = latest_complete(tmp_path)
    assert latest is not None
    step = int(latest.name.split("_")[1])
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    CheckpointManager(tmp_path).load(
        latest, model, build_adamw(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    )
    assert all(bool((p == step).all()) for p in model.parameters())


def test_saving_a_step_again_replaces_it_only_once_the_new_one_is_complete(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    model = toy.build(0)
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(4, model, optimizer, trainer_state={"step": 4, "run": "first"}, rank_state={})
    first = {n: p.detach().clone() for n, p in model.named_parameters()}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the tensor write")

    with monkeypatch.context() as patch:
        patch.setattr(dcp, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            manager.save(4, model, optimizer, trainer_state={"step": 4, "run": "second"}, rank_state={})
    # The interrupted rewrite left the complete step 4 as it was (keep_last=1: it is the only checkpoint).
    assert latest_complete(tmp_path) == tmp_path / "step_00000004"
    fresh = toy.build(1)
    assert manager.load(tmp_path / "step_00000004", fresh, build_adamw(fresh, **ADAM))[0]["run"] == "first"
    assert all(torch.equal(p, first[n]) for n, p in fresh.named_parameters())

    _train_step(model, optimizer, 3)
    manager.save(4, model, optimizer, trainer_state={"step": 4, "run": "second"}, rank_state={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
    fresh = toy.build(1)
    assert manager.load(tmp_path / "step_00000004", fresh, build_adamw(fresh, **ADAM))[0]["run"] == "second"
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))


def _saved_with(tmp_path, multipliers: dict) -> tuple[CheckpointManager, object]:
    model = toy.build(0)
    optimizer = build_adamw(model, lr_multipliers=multipliers, **ADAM)
    _train_step(model, optimizer, 1)
    manager = CheckpointManager(tmp_path)
    return manager, manager.save(1, model, optimizer, trainer_state={"step": 1}, rank_state={})


@pytest.mark.parametrize(
    "then, now, problem",
    [
        # Same group count, other members: embed's x2 group would land on the matrices.
        (
            {"embed": 2.0},
            {"head": 2.0},
            r"2 parameters changed optimizer group: embed.weight saved \{'decayed': True, 'lr_multiplier': 2.0\}",
        ),
        ({}, {"embed": 2.0}, r"embed.weight saved \{'decayed': True, 'lr_multiplier': 1.0\}, now"),
    ],
)
def test_optimizer_groups_must_hold_the_same_parameters(tmp_path, then, now, problem):
    manager, path = _saved_with(tmp_path, then)
    model = toy.build(1)
    optimizer = build_adamw(model, lr_multipliers=now, **ADAM)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointMismatchError, match=problem):
        manager.load(path, model, optimizer)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing was loaded
    # The same grouping loads, with another weight decay value too (the saved one is optimizer state).
    model = toy.build(1)
    manager.load(path, model, build_adamw(model, lr_multipliers=then, **ADAM))
    model = toy.build(1)
    manager.load(path, model, build_adamw(model, lr_multipliers=then, **{**ADAM, "weight_decay": 0.05}))


def _groups(model, decayed_lr: float, flat_lr: float, split: bool) -> list[dict]:
    # The grouping build_adamw makes with EP (split: the decayed matrices in two groups, as experts sit apart from
    # the dense ones on their own mesh, the undecayed group last) and without (one decayed group).
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    flat = [p for p in model.parameters() if p.dim() < 2]
    parts = [decayed[:2], decayed[2:]] if split else [decayed]
    return [{"params": part, "weight_decay": 0.1, "lr": decayed_lr} for part in parts] + [
        {"params": flat, "weight_decay": 0.0, "lr": flat_lr}
    ]


def test_coarser_optimizer_groups_keep_the_hyperparameters_of_their_saved_groups(tmp_path):
    # Saved with three groups (EP), loaded into two (EP off): each group takes the saved settings of the group its
    # parameters were in, not of the saved group at its index (the undecayed group is saved third, loaded second).
    model = toy.build(0)
    optimizer = torch.optim.AdamW(_groups(model, 1e-2, 3e-2, split=True))
    _train_step(model, optimizer, 1)
    path = CheckpointManager(tmp_path).save(1, model, optimizer, trainer_state={"step": 1}, rank_state={})
    fresh = toy.build(1)
    fresh_opt = torch.optim.AdamW(_groups(fresh, 5e-3, 5e-3, split=False))
    CheckpointManager(tmp_path).load(path, fresh, fresh_opt)
    got = [(g["weight_decay"], g.get("lr"), len(g["params"])) for g in fresh_opt.param_groups]
    assert got == [(0.1, 1e-2, 6), (0.0, 3e-2, 10)]
    _train_step(fresh, fresh_opt, 2)
    _train_step(model, optimizer, 2)
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- resharding across world sizes and EP


def _full(param: torch.Tensor, ep_group) -> torch.Tensor:
    full = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
    if ep_group is None:
        return full
    parts = [torch.empty_like(full) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, full.contiguous(), group=ep_group)
    return torch.cat(parts)


def _save_with_failing_side_files(ctx, root: str) -> str:
    model = toy.build(0, ctx.device)
    optimizer = build_adamw(model, **ADAM)

    def side_files(out) -> None:
        raise OSError("no space left for the tokenizer")

    try:
        CheckpointManager(root).save(1, model, optimizer, trainer_state={}, rank_state={}, model_files=side_files)
    except (OSError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_a_rank0_side_file_failure_is_raised_on_every_rank_not_a_hang(dist_pools, tmp_path):
    # Rank 0 alone writes hf_files/ while the others already wait in the collective DCP save.
    first, second = dist_pools.get(2).run(_save_with_failing_side_files, str(tmp_path))
    assert first == "OSError: no space left for the tokenizer"
    assert second.startswith("RuntimeError: checkpoint") and "hf_files/ failed on rank 0: OSError" in second
    assert "no space left for the tokenizer" in second


def _save_sharded(ctx, root: str, ep: int) -> dict:
    state = build_parallel_state(ParallelDims.for_world(ctx.world_size, ep=ep), ctx.device_type)
    model = toy.build(0, ctx.device, moe=True, num_experts=4)
    apply_fsdp2(model, state, FSDPPolicy(block_patterns=("layers.*",)), toy.MOE_PLAN)
    model.set_ep_group(state.ep_group if ep > 1 else None)
    optimizer = build_adamw(model, **ADAM)
    _train_step(model, optimizer, 10 + ctx.rank)
    CheckpointManager(root, parallel_state=state).save(
        1, model, optimizer, trainer_state={"step": 1}, rank_state={"rank": ctx.rank}
    )
    ep_group = state.ep_group if ep > 1 else None
    params, moments = {}, {}
    for name, param in model.named_parameters():
        is_expert = ".experts." in name
        params[name] = _full(param, ep_group if is_expert else None).cpu()
        moments[name] = _full(optimizer.state[param]["exp_avg"], ep_group if is_expert else None).cpu()
    return {"params": params, "moments": moments}


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4))
def test_sharded_ep_checkpoint_loads_in_one_process(dist_pools, tmp_path, world_size, backend):
    for ep in (2, world_size) if world_size == 4 else (2,):
        root = tmp_path / f"ep{ep}"
        saved = dist_pools.get(world_size, backend).run(_save_sharded, str(root), ep)[0]
        model = toy.build(
            7, moe=True, num_experts=4
        )  # other weights: everything must come from the checkpoint
        optimizer = build_adamw(model, **ADAM)
        _, rank_state = CheckpointManager(root).load(latest_complete(root), model, optimizer)
        assert rank_state == {"rank": 0}
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), saved["params"][name]), name
            assert torch.equal(optimizer.state[param]["exp_avg"], saved["moments"][name]), name


def test_an_async_save_is_complete_once_written_without_waiting_for_the_next_save(tmp_path):
    """The marker follows the background write, not the next save: a run that dies mid-interval (after the write
    finished, before the next save or the end) must resume from that checkpoint, not from the one before it."""
    model = toy.build(0)
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(tmp_path, async_save=True)
    path = manager.save(5, model, optimizer, trainer_state={"step": 5}, rank_state={})
    future = manager._pending[0]
    future.result()  # the write is done; the training thread never called wait() (it is still training)
    deadline = time.monotonic() + 10
    while not (path / MARKER).is_file() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert latest_complete(tmp_path) == path
    manager.wait()  # still fine afterwards: the pending save is settled once
    assert latest_complete(tmp_path) == path


def _async_saves_marked_by_rank0(ctx, root: str) -> tuple[bool, list[str], list[str]]:
    state = build_parallel_state(ParallelDims.for_world(ctx.world_size), ctx.device_type)
    model = toy.build(0, ctx.device)
    apply_fsdp2(model, state, FSDPPolicy(block_patterns=("layers.*",)))
    optimizer = build_adamw(model, **ADAM)
    manager = CheckpointManager(root, keep_last=1, async_save=True, parallel_state=state)
    for step in (1, 2):
        _train_step(model, optimizer, step + ctx.rank)
        path = manager.save(
            step, model, optimizer, trainer_state={"step": step}, rank_state={"rank": ctx.rank}
        )
    manager._pending[0].result()  # written on every rank (DCP's collective finish), nobody waited yet
    deadline = time.monotonic() + 5
    while ctx.rank == 0 and not (path / MARKER).is_file() and time.monotonic() < deadline:
        time.sleep(0.01)
    marked_early = (path / MARKER).is_file()
    manager.wait()
    dist.barrier()
    return marked_early, sorted(p.name for p in path.parent.iterdir()), sorted(p.name for p in path.iterdir())


def test_async_saves_on_two_ranks_are_marked_and_pruned_by_rank0_after_the_write(dist_pools, tmp_path):
    first, second = dist_pools.get(2).run(_async_saves_marked_by_rank0, str(tmp_path))
    assert first[0]  # rank 0 marked step 2 complete as soon as the write ended
    assert first[1:] == second[1:]
    assert first[1] == ["step_00000002"]  # keep_last=1 pruned step 1 after step 2 completed
    assert first[2] == [MARKER, "dcp", "rank_00000.pt", "rank_00001.pt", "trainer.pt"]
    model = toy.build(7)
    optimizer = build_adamw(model, **ADAM)
    trainer_state, rank_state = CheckpointManager(tmp_path).load(latest_complete(tmp_path), model, optimizer)
    assert trainer_state == {"step": 2} and rank_state == {"rank": 0}


def _save_with_a_failing_rank_file(ctx, root: str) -> str:
    model = toy.build(0, ctx.device)
    optimizer = build_adamw(model, **ADAM)
    # Rank 1's own file cannot be written (a full disk or quota there; here: state torch.save cannot pickle).
    rank_state = {"data": (lambda: None) if ctx.rank == 1 else 0}
    try:
        CheckpointManager(root).save(1, model, optimizer, trainer_state={}, rank_state=rank_state)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_a_rank_file_failure_on_any_rank_is_raised_on_every_rank_not_a_hang(dist_pools, tmp_path):
    # Rank 1 fails writing rank_00001.pt while rank 0 goes on into the collective DCP save: both must raise.
    first, second = dist_pools.get(2).run(_save_with_a_failing_rank_file, str(tmp_path))
    assert first.startswith("RuntimeError: checkpoint") and "rank 1:" in first and "pickle" in first
    assert "pickle" in second and not second.startswith("RuntimeError: checkpoint")  # rank 1's own error
    assert latest_complete(tmp_path) is None
