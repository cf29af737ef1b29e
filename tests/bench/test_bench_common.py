"""tools/bench/bench_common's phase split of the GPU's idle time (`idle_by_phase`) and bench_omni's phase marks."""

from __future__ import annotations

import math

import pytest
import torch
from bench_loader import load_bench

common = load_bench("bench_common.py")
omni = load_bench("bench_omni.py")


def test_each_idle_gap_is_charged_to_the_phase_the_host_was_in_when_it_ended():
    kernels = [(10.0, 20.0), (25.0, 30.0), (28.0, 40.0), (100.0, 110.0)]  # us; the third overlaps the second
    marks = [(0.0, "a"), (22.0, "b"), (50.0, "c")]
    # 0-10 before the first kernel (host in a), 20-25 (b began at 22), 40-100 (c); the overlap is busy time.
    assert common.idle_by_phase(kernels, marks) == {"c": 0.06, "a": 0.01, "b": 0.005}


def test_the_window_starts_at_the_first_mark():
    # The kernel at 5-6 us ran before the profiled step began: neither it nor the gap before it counts.
    assert common.idle_by_phase([(5.0, 6.0), (20.0, 21.0)], [(10.0, "x")]) == {"x": 0.01}


def test_tower_marks_follow_the_thinker_through_forward_and_backward(tmp_path):
    config = omni.thinker_config(tiny=True)
    args = omni.parse_args(["--tiny", "--out", str(tmp_path / "o.json")])
    torch.manual_seed(0)
    model = omni.Upstream(config)
    batch = omni.mixed_batch(config, args, torch.device("cpu"))
    hooks = omni.tower_marks(model)
    with torch.profiler.profile() as prof:
        model(**batch, use_cache=False).loss.backward()
    for hook in hooks:
        hook.remove()
    marks = [e.name[len(common.MARK) :] for e in sorted(prof.events(), key=lambda e: e.time_range.start)]
    marks = [m for m in marks if not m.startswith(("aten::", "autograd::"))]
    expected = ["forward: audio tower", "forward: text", "forward: vision tower", "forward: text"]
    assert [m for m in marks if m.startswith("forward")] == expected
    # Backward runs the towers in reverse: the vision tower's gradient arrives first.
    assert [m for m in marks if m.startswith("backward")] == ["backward: vision tower", "backward: audio tower"]
    with torch.profiler.profile() as again:
        model(**batch, use_cache=False)
    assert not [e for e in again.events() if e.name.startswith(common.MARK)]  # the hooks are gone


@pytest.mark.parametrize("value", ["end", "step"])
def test_loss_read_choices(value, tmp_path):
    assert omni.parse_args(["--out", str(tmp_path / "o.json"), "--loss-read", value]).loss_read == value


def test_worst_error_is_nan_when_any_error_is_nan():
    nan = float("nan")
    assert common.worst([0.1, 0.3, 0.2]) == 0.3
    assert common.worst([], default=0.0) == 0.0
    # Python's max keeps a NaN only when it comes first; an agreement check must see it wherever it is.
    for values in ([nan, 0.1], [0.1, nan], [0.1, 0.2, nan]):
        assert math.isnan(common.worst(values))
