"""Smoke test of tools/bench/bench_grouped_gemm.py on CPU (fp32, tiny shape): every GEMM runs for both routings,
the grouped results equal the per-expert loop, and the JSON carries the ratios the benchmark exists for."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

bench = load_bench("bench_grouped_gemm.py")


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_every_gemm_runs_and_matches_the_loop(tmp_path):
    out = tmp_path / "gg.json"
    bench.main(["--out", str(out), "--device", "cpu", "--tiny", "--dtype", "float32", "--warmup", "0", "--reps", "1"])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"tiny/aligned", "tiny/random"}
    assert rows["tiny/aligned"]["rows_per_expert_min_max"] == [10, 10]
    low, high = rows["tiny/random"]["rows_per_expert_min_max"]
    assert low < high
    # 4 experts x one 128-row tile for 40 rows, either way.
    assert rows["tiny/aligned"]["tiles_of_128_over_ideal"] == rows["tiny/random"]["tiles_of_128_over_ideal"] == 12.8
    for row in rows.values():
        assert set(row["gemms"]) == {f"{k}_{p}" for k in ("fwd", "dgrad", "wgrad") for p in ("gate_up", "down")}
        for gemm in row["gemms"].values():
            assert gemm["rel_err_vs_loop"] <= 1e-6
            assert gemm["grouped_ms"] > 0 and gemm["dense_ms"] > 0


def test_unknown_shape_is_refused_with_the_known_names(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--out", "x.json", "--shapes", "deepseek_v2"])
    assert "deepseek_v3" in capsys.readouterr().err
