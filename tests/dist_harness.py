"""A pool of long-lived ranks with a real process group, driven from the pytest process.

Starting processes and a process group costs seconds; running one collective costs microseconds. Property tests
draw hundreds of examples, so the pool is started once per (world size, backend) and every example is shipped to
all ranks as a task: ``pool.run(fn, *args)`` calls ``fn(ctx, *args)`` on every rank and returns the per-rank
results. ``fn`` must be a module-level function (it is pickled by reference); ``ctx`` is a `RankContext`.

Tasks and results travel by value (plain pickle): a multiprocessing connection's own pickler would move every
tensor into shared memory and hand the other side an alias of it, so a result could change after it was returned
when the rank later updated the tensor in place (a parameter, an optimizer state), and a comparison could then
look at the same memory twice.

A task that raises on any rank fails the call with every rank's traceback; the pool stays up when every rank
answered. A rank that does not answer within the timeout (for example, stuck in a collective its failed peer never
joined) gets the whole pool killed, so the next task starts a fresh one instead of hanging.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

# A GPU run whose Triton kernels autotune on first use (fla's Gated DeltaNet: minutes on a cold cache) raises it.
TASK_TIMEOUT_S = float(os.environ.get("VEOMNI_TEST_TASK_TIMEOUT", "120"))


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_params(*world_sizes: int) -> list:
    """(world_size, backend) parameters: gloo always; nccl marked multi_gpu, skipped without the GPUs."""
    params = [pytest.param(ws, "gloo", id=f"gloo-{ws}") for ws in world_sizes]
    params += [
        pytest.param(
            ws,
            "nccl",
            id=f"nccl-{ws}",
            marks=[
                pytest.mark.multi_gpu,
                pytest.mark.skipif(gpu_count() < ws, reason=f"needs {ws} CUDA GPUs"),
            ],
        )
        for ws in world_sizes
        if ws > 1
    ]
    return params


def _send(conn, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn) -> Any:
    return pickle.loads(conn.recv_bytes())


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    backend: str

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    @property
    def device(self):  # torch.device; torch is imported lazily so the pytest process stays light
        import torch

        return torch.device("cuda", self.rank) if self.backend == "nccl" else torch.device("cpu")


def _worker(rank: int, world_size: int, backend: str, init_file: str, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TASK_TIMEOUT_S / 2),
        **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}),
    )
    ctx = RankContext(rank=rank, world_size=world_size, backend=backend)
    _send(conn, ("ready", None))
    while True:
        msg = _recv(conn)
        if msg is None:
            break
        path_entries, fn, args, kwargs = msg
        for entry in path_entries:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            result = fn(ctx, *args, **kwargs)
            _send(conn, ("ok", result))
        except BaseException:  # noqa: BLE001 - every failure goes back to the driver
            _send(conn, ("error", traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` ranks on ``backend`` ('gloo' on CPU, 'nccl' with one GPU per rank)."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self._tmp = tempfile.TemporaryDirectory(prefix="veomni-dist-")
        init_file = os.path.join(self._tmp.name, "store")
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, world_size, backend, init_file, child), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(TASK_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"rank {rank} of a {world_size}-rank {backend} pool did not start")
            _recv(conn)
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order."""
        if self.broken:
            raise RuntimeError("this DistPool was killed after a failed task; get a fresh one")
        msg = (list(sys.path), fn, args, kwargs)
        for conn in self._conns:
            _send(conn, msg)
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(TASK_TIMEOUT_S if not errors else 10.0):
                errors.append(f"rank {rank}: no answer (hung in a collective?)")
                self.close()
                break
            status, value = _recv(conn)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            # A rank that did not answer is stuck mid-collective and close() above killed the pool. When every
            # rank answered, none is inside a collective, so the group stays usable for the next task.
            raise AssertionError(
                f"{fn.__name__} failed on {self.world_size} ranks ({self.backend}):\n" + "\n".join(errors)
            )
        return results

    def close(self) -> None:
        self.broken = True
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                _send(conn, None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._tmp.cleanup()
