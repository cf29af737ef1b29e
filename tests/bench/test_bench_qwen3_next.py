"""Smoke and parity test of tools/bench/bench_qwen3_next.py on CPU: a tiny Qwen3-Next / Qwen3.5 stack, ours vs
transformers.

One document (transformers' torch reference ignores packing), fp32: both contenders must compute the same logits and
loss from the same weights and data; the timing fields are only checked for presence.
"""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

bench = load_bench("bench_qwen3_next.py")


@pytest.mark.slow  # slow tier: runs a bench script end to end
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_tiny_stack_matches_transformers(tmp_path, family):
    out = tmp_path / "q3n.json"
    returned = bench.main(["--out", str(out), "--tiny", "--device", "cpu", "--tokens", "48", "--min-doc", "48",
                           "--reps", "1", "--layers", "4", "--family", family])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["documents"] == 1 and result["config"]["model_type"] in (family, f"{family}_text")
    assert result["veomni_ops"]["gated_delta_rule"] == "eager"
    for name in ("veomni", "hf"):
        row = result["rows"][name]
        assert "error" not in row, row
        assert row["ms"] > 0 and row["tokens_per_s"] > 0
    assert abs(result["rows"]["veomni"]["loss"] - result["rows"]["hf"]["loss"]) < 1e-4
    assert returned["logits_rel_err"] < 1e-4 and result["speedup_tokens_per_s"] > 0
