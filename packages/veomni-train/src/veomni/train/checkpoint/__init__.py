"""Training checkpoints: model + optimizer through torch DCP (sharded, resharded on load), everything else beside.

Layout of one checkpoint, ``<dir>/step_00000100/``:

    dcp/                 model and optimizer state (torch.distributed.checkpoint), loadable at another world size
    trainer.pt           rank 0: step counters, scheduler state, world/DP/SP/EP sizes, the resolved recipe and
                         the model config (compared with the resuming run's, see `checkpoint_match.config_diff`)
    rank_00003.pt        per rank: RNG states (python, numpy, torch CPU, accelerator); the data position is global,
                         in trainer.pt
    hf_files/            rank 0: what the task's HF export writes beside the weights (the trained config.json,
                         generation_config.json, tokenizer, processor files), so that the offline export
                         (`veomni.models.export.export_dcp_to_hf` on ``dcp/``) equals the in-loop one; for the
                         dit task only the diffusers config.json; absent in checkpoints written before it existed
    COMPLETE             written last, atomically (write + rename), by rank 0 after every rank finished

Loading is strict both ways: before any tensor is read, the checkpoint's tensor names and global shapes (DCP
metadata) are compared with the model's and the optimizer's, and a difference is a `CheckpointMismatchError`
listing it -- a checkpoint of a 4-layer model never silently fills 2 layers of another. Global shapes do not depend
on the world size, so resharding onto another number of ranks (or EP degree) still loads.

`latest_complete` only ever returns directories with ``COMPLETE``: a process killed during a save leaves an
incomplete directory that is ignored (and pruned by the next successful save, as is one set aside as
``step_N.abandoned``), and the previous checkpoint stays loadable; a re-save of a step killed between its two
renames resumes from its complete new copy. Keep-last-K pruning runs only after the new checkpoint is complete.

What goes into ``dcp/`` (expert-parallel views, optimizer state as it is) is `veomni.train.checkpoint.state`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict

from veomni.core.parallel_state import ParallelState
from veomni.models.export.files import CHECKPOINT_FILES_DIR
from veomni.train.checkpoint.match import check_payload_matches, saved_param_group_slots
from veomni.train.checkpoint.state import checkpoint_view, load_optimizer, state_dicts

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
STAGED_DIR = re.compile(r"^step_(\d{8})\.(new|old)$")  # a re-save's new copy and the one it replaces
# A directory `CheckpointManager.set_aside_newer` renamed (``step_N.abandoned``, ``step_N.new.abandoned2``, ...).
SET_ASIDE_DIR = re.compile(r"^step_(\d{8})(\.new|\.old)?\.abandoned\d*$")
MARKER = "COMPLETE"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_complete(root: str | os.PathLike) -> Path | None:
    """The newest ``step_*`` directory under ``root`` that has a ``COMPLETE`` marker, or None.

    A re-save of a complete step that died during its swap left a complete new copy ``step_N.new`` (its marker is
    written before the two renames), beside ``step_N`` or in its place: that copy is the newer state of step N and
    stands for it. Directories are only read here (every rank calls this); the next save finishes the swap.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    found = {}
    for p in root.iterdir():
        if (m := STEP_DIR.match(p.name)) and (p / MARKER).is_file():
            found[int(m.group(1))] = p
    for p in root.iterdir():
        if (m := STAGED_DIR.match(p.name)) and m.group(2) == "new" and (p / MARKER).is_file():
            found[int(m.group(1))] = p
    return found[max(found)] if found else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _raise_on_every_rank(failure: BaseException | None, what: str) -> None:
    """Raise every rank's ``failure`` on every rank (a failed rank its own exception, the others a RuntimeError
    naming each failed rank's): a rank-local step before a collective save (its own files, rank 0's trainer.pt and
    hf_files/) must not leave the other ranks waiting in DCP for it. Every rank must call it."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    messages = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, mine)
    if failure is not None:
        raise failure
    if failed := [f"rank {rank}: {message}" for rank, message in enumerate(messages) if message is not None]:
        raise RuntimeError(f"{what} " + "; ".join(failed))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """Rank 0's ``trainer.pt`` of a complete checkpoint (step, schedule, data position, recipe, model config)."""
    path = Path(path)
    check_complete(path)
    return torch.load(path / "trainer.pt", weights_only=False)


def check_complete(path: str | os.PathLike) -> None:
    """Raise ``FileNotFoundError`` unless ``path`` is a complete checkpoint (a step directory with ``COMPLETE``)."""
    path = Path(path)
    if (path / MARKER).is_file():
        return
    if not path.exists():
        raise FileNotFoundError(
            f"no such directory: {path} (expected auto, never, or a step_* directory with a {MARKER} marker)"
        )
    hint = ""
    if (newest := latest_complete(path)) is not None:
        # A run's checkpoint.dir given where one of its step directories is meant.
        hint = f"; it is a checkpoint directory: pass one of its step directories, e.g. the newest, {newest}"
    raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker){hint}")


# ---------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Every RNG the loop touches: python, numpy, torch CPU and the current accelerator's."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- save / load


class CheckpointManager:
    """Saves and restores training state under ``root``; every rank must call `save`/`load` together.

    Args:
        root: the checkpoint directory (shared by all ranks).
        keep_last: complete checkpoints to keep (older ones are deleted after a new one completes); 0 keeps all.
        async_save: stage the model/optimizer state to CPU and write it in a background thread; rank 0 writes the
            step's ``COMPLETE`` marker (and prunes) in that thread as soon as the write finishes, so a run that dies
            before its next save still resumes from it. The next save and `wait` wait for both.
        parallel_state: the training topology (needed for expert-parallel models).
        trained_only: save and load only the parameters that train (``requires_grad``): a LoRA run's adapters
            (and modules trained in full), its frozen base being re-read from the model's weights on resume.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int = 0,
        async_save: bool = False,
        parallel_state: ParallelState | None = None,
        trained_only: bool = False,
    ):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.state = parallel_state
        self.trained_only = trained_only
        # (the DCP write, rank 0's marking of the step as complete after it, step dir)
        self._pending: tuple[Future, Future, Path] | None = None
        self._async_group = None
        if async_save and dist.is_initialized():
            # Async DCP coordinates through a CPU-capable group; with NCCL training that must be a gloo group.
            self._async_group = dist.new_group(backend="gloo")

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        trainer_state: Mapping[str, Any],
        rank_state: Mapping[str, Any],
        model_files: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint ``step``. ``trainer_state`` (rank 0's) and ``rank_state`` (each rank's) are torch-saved;
        rank 0 calls ``model_files(<step>/hf_files)`` to write the model's HF config and tokenizer files there
        (the task's ``checkpoint_files``).

        A complete checkpoint of the same step is replaced only once the new one is complete: the new one is
        written beside it (``step_N.new``) and swapped in by two renames, so a save killed midway leaves it loadable.
        """
        self.wait()
        path = step_dir(self.root, step)
        # Every rank decides the same: the previous save's marker was written before its closing barrier.
        staging = path.with_name(path.name + ".new") if (path / MARKER).is_file() else path
        if _rank() == 0:
            if staging.exists():
                shutil.rmtree(staging)  # a leftover of an interrupted save of the same step
            staging.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = state_dicts(model, optimizer)
        payload = checkpoint_view(model, self.state, self._kept(model, model_sd), optim_sd)
        failure = None
        try:
            torch.save({**rank_state, "rng": rng_state()}, staging / f"rank_{_rank():05d}.pt")
            if _rank() == 0:
                torch.save(dict(trainer_state), staging / "trainer.pt")
                if model_files is not None:
                    model_files(staging / CHECKPOINT_FILES_DIR)
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            failure = err
        _raise_on_every_rank(
            failure,
            f"checkpoint {path}: writing the rank files, trainer.pt or {CHECKPOINT_FILES_DIR}/ failed on",
        )
        if self.async_save:
            future = dcp.async_save(payload, checkpoint_id=staging / "dcp", process_group=self._async_group)
            written = getattr(future, "upload_completion", future)
            marked: Future = Future()
            if _rank() == 0:
                # DCP's coordinator (rank 0) finishes only after every rank's write (and every rank wrote its own
                # files before entering the collective save), so rank 0 alone can mark the step complete.
                written.add_done_callback(lambda done: self._mark_when_written(done, staging, path, marked))
            else:
                marked.set_result(None)
            self._pending = (written, marked, path)
        else:
            dcp.save(payload, checkpoint_id=staging / "dcp")
            self._finish(staging, path)
        return path

    def _kept(self, model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
        # The frozen base of a LoRA run is the model's weights, unchanged: only what trains is checkpointed.
        if not self.trained_only:
            return model_sd
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in model_sd.items() if k in trained}

    def set_aside_newer(self, step: int) -> list[Path]:
        """Rename every step directory above ``step`` (complete or not) to ``<name>.abandoned`` (``.abandoned2``,
        ... if taken), before a run that continues from ``step`` writes into ``root``: they belong to another line
        of training (a run rolled back to an older checkpoint, or started fresh in a used directory). Left in place,
        ``resume=auto`` would later take them for this run's newest state, and keep-last pruning, which keeps the
        highest steps, would delete this run's new checkpoints first. Nothing is deleted here; the next complete
        save prunes the incomplete ones (saves killed midway, never loadable) and keeps the complete ones.

        Every rank must call it (rank 0 renames, then a barrier). Returns the new paths (rank 0; empty elsewhere).
        """
        moved: list[Path] = []
        if _rank() == 0 and self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                m = STEP_DIR.match(p.name) or STAGED_DIR.match(p.name)
                if m is None or int(m.group(1)) <= step:
                    continue
                target, n = p.with_name(p.name + ".abandoned"), 1
                while target.exists():
                    n += 1
                    target = p.with_name(f"{p.name}.abandoned{n}")
                p.rename(target)
                moved.append(target)
        _barrier()
        return moved

    def wait(self) -> None:
        """Block until a pending async save is written and marked complete (every rank must call it)."""
        if self._pending is None:
            return
        written, marked, path = self._pending
        self._pending = None
        written.result()  # a failed write raises on every rank (DCP reports it to all)
        # Rank 0 marked the step in the writer's thread; a failure there is raised on every rank.
        failure = marked.exception()
        _raise_on_every_rank(failure, f"checkpoint {path}: marking it complete failed on")
        _barrier()  # every rank sees the marker and the pruned directory before its next save looks at them
        log.info("checkpoint %s complete", path)

    def _mark_when_written(self, written: Future, staging: Path, path: Path, marked: Future) -> None:
        # Runs in the DCP writer's thread on rank 0 (or here, if the write is already done); never raises, so the
        # outcome reaches `wait` through ``marked``.
        try:
            if written.exception() is None:
                self._mark_complete(staging, path)
        except BaseException as err:  # noqa: BLE001 - handed to wait(), which raises it on every rank
            marked.set_exception(err)
        else:
            marked.set_result(None)

    def _finish(self, staging: Path, path: Path) -> None:
        _barrier()  # every rank's files are written
        if _rank() == 0:
            self._mark_complete(staging, path)
        _barrier()
        log.info("checkpoint %s complete", path)

    def _mark_complete(self, staging: Path, path: Path) -> None:
        """Rank 0, once every rank's files are written: the marker, the swap of a re-save, then pruning."""
        tmp = staging / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"step_dir": path.name}))
        os.replace(tmp, staging / MARKER)
        if staging != path:
            old = path.with_name(path.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
            staging.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        self._prune(keep=path)

    def _settle_interrupted_swaps(self) -> None:
        # A re-save killed during its swap: a complete step_N.new is the newer state of step N and replaces
        # step_N (what `latest_complete` resumed from); the rest of the staged copies is dropped.
        for p in sorted(self.root.iterdir()):
            m = STAGED_DIR.match(p.name)
            if m is None or m.group(2) != "new" or not (p / MARKER).is_file():
                continue
            target = p.with_name(f"step_{m.group(1)}")
            if target.exists():
                shutil.rmtree(target)
            p.rename(target)
            log.info("checkpoint %s: finished the swap of an interrupted re-save (%s)", target, p.name)

    def _prune(self, keep: Path) -> None:
        self._settle_interrupted_swaps()
        current = int(STEP_DIR.match(keep.name).group(1))
        complete, stale = [], []
        for p in self.root.iterdir():
            if STAGED_DIR.match(p.name):
                stale.append(p)  # an incomplete staging copy, or the replaced copy of a finished swap
                continue
            if SET_ASIDE_DIR.match(p.name) and not (p / MARKER).is_file():
                stale.append(p)  # another line's save killed midway, set aside: never loadable
                continue
            m = STEP_DIR.match(p.name)
            if not m:
                continue
            step = int(m.group(1))
            if (p / MARKER).is_file():
                complete.append((step, p))
            elif step < current:
                stale.append(p)  # an interrupted save: never loadable
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        if self.keep_last:
            for _, p in sorted(complete)[: -self.keep_last]:
                shutil.rmtree(p, ignore_errors=True)

    def load(
        self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Restore model and optimizer in place from ``path`` (any world size); restore this rank's RNG.

        Raises:
            CheckpointMismatchError: the checkpoint's tensors are not this model's / optimizer's (nothing loaded).
        Returns:
            ``(trainer_state, rank_state)``; ``rank_state`` is None when the checkpoint has no file for this rank
            (a larger world than was saved) — the caller decides what to do with its data state.
        """
        path = Path(path)
        check_complete(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)  # (every parameter gets its state's tensors)
        model_sd = self._kept(model, model_sd)
        payload = checkpoint_view(model, self.state, model_sd, optim_sd)
        if stateless := check_payload_matches(path / "dcp", payload):
            # Trained parameters no gradient had reached when the checkpoint was saved: they stay without state,
            # as in the saving run, and AdamW creates it at their first gradient.
            log.info(
                "checkpoint %s: %d trained parameters have no optimizer state yet (no gradient reached them "
                "before it was saved): %s%s", path, len(stateless), ", ".join(stateless[:8]),
                f" ... and {len(stateless) - 8} more" if len(stateless) > 8 else "",
            )  # fmt: skip
            for fqn in stateless:
                payload["optim"]["state"].pop(fqn, None)
                optim_sd["state"].pop(fqn, None)
        names = [list(group["params"]) for group in optim_sd["param_groups"]]
        # DCP fills a list by index: this run's param_groups would take the first len(groups) saved groups, whatever
        # parameters those held, and coarser groups (EP experts merged back) would miss the saved groups past
        # them. Every saved group is loaded instead, and set_state_dict hands each of this run's groups the
        # settings of the saved group its parameters (by name) were in.
        saved_groups = saved_param_group_slots(path / "dcp")
        if saved_groups is not None:
            payload["optim"]["param_groups"] = optim_sd["param_groups"] = saved_groups
        dcp.load(payload, checkpoint_id=path / "dcp")
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not self.trained_only))
        load_optimizer(model, optimizer, optim_sd, names)
        trainer_state = torch.load(path / "trainer.pt", weights_only=False)
        rank_file = path / f"rank_{_rank():05d}.pt"
        rank_state = torch.load(rank_file, weights_only=False) if rank_file.is_file() else None
        if rank_state is not None:
            set_rng_state(rank_state.pop("rng"))
        return trainer_state, rank_state
