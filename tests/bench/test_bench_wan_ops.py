"""Smoke test of tools/bench/bench_wan_ops.py on CPU (fp32, tiny shapes, no compiled rows): every row runs, the JSON
holds them, and veomni's rows compute diffusers' numbers."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

pytest.importorskip("diffusers")
bench = load_bench("bench_wan_ops.py")


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_rows_run_and_match_diffusers(tmp_path):
    out = tmp_path / "wan_ops.json"
    bench.main(["--out", str(out), "--device", "cpu", "--tokens", "24", "--heads", "2", "--dtype", "fp32",
                "--reps", "2", "--no-compile"])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    # CPU defaults: diffusers' own norm and rotary code ("eager"), veomni's sdpa attention.
    assert set(rows) == {
        "rotary/diffusers", "rotary/veomni_eager", "qk_norm/diffusers", "qk_norm/veomni_eager",
        "self_attention/diffusers", "self_attention/veomni_sdpa",
    }  # fmt: skip
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["ms"] > 0 and row["fwd_ms"] > 0
    for name in ("rotary/veomni_eager", "qk_norm/veomni_eager", "self_attention/veomni_sdpa"):
        assert rows[name]["max_abs_vs_diffusers"] <= 1e-6, name
