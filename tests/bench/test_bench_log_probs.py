"""Smoke test of tools/bench/bench_log_probs.py on CPU (``--size tiny``, fp32; Triton through its interpreter):
every contender runs or reports why not, the log-probs contenders agree with the chunked reference, the JSON
written equals the result returned."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

bench = load_bench("bench_log_probs.py")


@pytest.mark.slow  # slow tier: runs a bench script end to end
@pytest.mark.triton_cpu
def test_tiny_run_reports_every_contender(tmp_path):
    out = tmp_path / "log_probs.json"
    returned = bench.main(["--size", "tiny", "--reps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    assert result["shape"] == {"tokens": 64, "hidden": 32, "vocab": 300} and result["dtype"] == "float32"
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == list(bench.CONTENDERS)
    for name in ("triton", "triton_entropy", "chunked_entropy", "eager_entropy", "ce_triton"):
        row = rows[name]
        assert "error" not in row, row
        assert row["ms"] > 0 and row["peak_extra_mib"] is None  # no allocator peak off CUDA
    for name in ("triton", "triton_entropy", "chunked_entropy", "eager_entropy"):
        assert rows[name]["logp_max_abs_err"] < 1e-5, rows[name]
    for name in ("triton_entropy", "chunked_entropy", "eager_entropy"):
        assert rows[name]["entropy"] is True and rows[name]["entropy_max_abs_err"] < 1e-5, rows[name]
    assert rows["triton"]["entropy"] is False and "entropy_max_abs_err" not in rows["triton"]
    # Liger runs on CUDA only (and is an optional extra): off CUDA its row is an error, not a crash.
    liger = rows["liger_ce"]
    assert "error" in liger or liger["ms"] > 0


def test_bad_command_lines_are_errors(tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(
            ["--size", "tiny", "--contenders", "triton,quack", "--out", str(tmp_path / "x.json")]
        )
    with pytest.raises(SystemExit):
        bench.parse_args(["--size", "tiny", "--reps", "0", "--out", str(tmp_path / "x.json")])
