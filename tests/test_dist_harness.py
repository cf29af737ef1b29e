"""The test harness's process pool returns values, not aliases of the ranks' memory."""

from __future__ import annotations

import torch

_KEPT: dict[str, torch.Tensor] = {}


def _make(ctx) -> torch.Tensor:
    _KEPT["t"] = torch.arange(4, dtype=torch.float32)
    return _KEPT["t"]


def _update_in_place(ctx) -> None:
    _KEPT["t"].add_(100)


def _add_to(ctx, t: torch.Tensor) -> None:
    t.add_(1)


def test_results_and_arguments_are_copies(dist_pools):
    # A connection's own pickler shares tensors through shared memory: a rank's later in-place update (a
    # parameter, an optimizer state) then changed a result the test already held, and a rank's update of an argument
    # changed the caller's tensor.
    pool = dist_pools.get(1, "gloo")
    (got,) = pool.run(_make)
    pool.run(_update_in_place)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
    sent = torch.zeros(3)
    pool.run(_add_to, sent)
    assert sent.tolist() == [0.0, 0.0, 0.0]
