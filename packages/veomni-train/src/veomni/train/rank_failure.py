"""One rank's failure stops every rank with one line each.

Under ``torchrun``, a rank that fails (a bad row, a bad checkpoint, a bug) leaves the others blocked in a
collective: on gloo they die with "Connection closed by peer" and a traceback once its sockets close, on NCCL they
hang until the collective times out. Instead the failing rank publishes its error in the c10d store of the default
process group (torchrun's agent hosts it, so it outlives the rank) before it exits, and every other rank stops
with exit code 2 and one line naming it::

    veomni-train (rank 1): stopping: rank 0 failed: DataError: /data/train.jsonl line 7: ...

The others notice it two ways: a `FailureWatch` thread polls the store (a rank blocked in a collective that does
not fail, e.g. NCCL's, is stopped from it with ``os._exit``), and the CLI's handler of an error in the main thread
(a gloo collective failing as the peer's sockets close) asks the store whether a peer failed first.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

# Keyed by torchrun's restart count: a store shared across elastic restarts must not hand a restarted rank the
# failure of the attempt that died.
_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

FAILED_KEY = f"veomni/attempt_{_ATTEMPT}/failed_rank"
"""The store key a failing rank writes ``"rank R failed: <error>"`` under (the first failure is kept)."""

DONE_KEY = f"veomni/attempt_{_ATTEMPT}/done_ranks"
"""A counter of the ranks that failed or stopped because of a failure (a failing rank waits for all of them)."""

STOPPED_EXIT_CODE = 2
"""The exit code of a rank stopped because another failed (as the failing rank's, for bad input)."""

_EXIT_GRACE_S = 1.0
"""Seconds a failing rank lingers once every rank has counted itself stopped."""


def _store() -> dist.Store | None:
    """The default process group's store on a multi-rank run; None on one rank or without a group."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # destroyed meanwhile
        return None


def publish_failure(
    rank: int, error: BaseException, wait: datetime.timedelta = datetime.timedelta(seconds=30)
) -> None:
    """Write ``rank``'s ``error`` to the store for the other ranks (the first failure published is the one kept),
    then wait up to ``wait`` for every rank to have stopped or failed: torchrun's agent kills the remaining ranks
    as soon as one exits, so leaving first would cut off their one line. A no-op on one rank."""
    store = _store()
    if store is None:
        return
    text = f"rank {rank} failed: {type(error).__name__}: {error}".splitlines()[0]
    world = dist.get_world_size()
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # the store's host gone: nobody left to tell
        store.compare_set(FAILED_KEY, "", text)
        deadline = time.monotonic() + wait.total_seconds()
        done = store.add(DONE_KEY, 1)
        while done < world and time.monotonic() < deadline:
            time.sleep(0.05)
            done = store.add(DONE_KEY, 0)
    # A stopped rank counts itself just before its ``os._exit``: leaving at once can still beat that exit, and
    # torchrun's agent would then SIGTERM it (exit code -15 instead of 2) on a loaded machine.
    time.sleep(_EXIT_GRACE_S)


def peer_failure(rank: int, wait: datetime.timedelta = datetime.timedelta(seconds=5)) -> str | None:
    """The failure another rank published, waiting up to ``wait`` for it (the peer writes it before its sockets
    close, so it is normally there already); None when no other rank failed."""
    store = _store()
    if store is None:
        return None
    try:
        store.wait([FAILED_KEY], wait)
        text = store.get(FAILED_KEY).decode()
    except (RuntimeError, ValueError, OSError):  # not published within the wait, or the store is gone
        return None
    return None if text.startswith(f"rank {rank} failed:") else text


class FailureWatch:
    """A daemon thread that stops this process (``os._exit(2)``, one line on stderr) when another rank publishes a
    failure; it waits for the process group to exist and ends when it is destroyed or `stop` is called.

    Args:
        rank: this process's rank.
        interval: seconds between two looks at the store.
    """

    def __init__(self, rank: int, interval: float = 0.5) -> None:
        self.rank, self.interval = rank, interval
        self._stopped = threading.Event()
        self._seen_group = False
        self._thread = threading.Thread(target=self._run, name="veomni-failure-watch", daemon=True)

    def start(self) -> FailureWatch:
        """Start polling; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (this rank is failing or finishing by itself)."""
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            store = _store()
            if store is None:
                if self._seen_group:  # destroyed: the run is over
                    return
                continue
            self._seen_group = True
            try:
                if not store.check([FAILED_KEY]):
                    continue
                text = store.get(FAILED_KEY).decode()
            except (RuntimeError, ValueError, OSError):
                continue
            if self._stopped.is_set() or text.startswith(f"rank {self.rank} failed:"):
                return
            stop_process(self.rank, text)


def stop_process(rank: int, failure: str) -> None:
    """Count this rank as stopped, print ``veomni-train (rank R): stopping: <failure>`` and exit with code 2 at once
    (no cleanup: the main thread may be blocked in a collective that will never finish)."""
    sys.stdout.flush()
    print(f"veomni-train (rank {rank}): stopping: {failure}", file=sys.stderr, flush=True)
    store = _store()
    if store is not None:
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            store.add(DONE_KEY, 1)
    os._exit(STOPPED_EXIT_CODE)
