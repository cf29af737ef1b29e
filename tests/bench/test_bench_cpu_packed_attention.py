"""Smoke test of tools/bench/bench_cpu_packed_attention.py (tiny shapes): both contenders run fwd+bwd on the same
packed row, agree, and the JSON carries the times, errors and the FLOPs ratio the benchmark exists for."""

from __future__ import annotations

import json
import math

import pytest
import torch
from bench_loader import load_bench

bench = load_bench("bench_cpu_packed_attention.py")


def test_documents_fill_the_row_exactly():
    for seq, mean in ((48, 6), (1024, 56), (7, 20)):
        lengths = bench.doc_lengths(seq, mean, seed=3)
        assert sum(lengths) == seq and min(lengths) >= 1 and max(lengths) <= 2 * mean - 1


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_tiny_contenders_agree_and_report_every_field(tmp_path):
    out = tmp_path / "attn.json"
    bench.main(["--out", str(out), "--tiny"])
    result = json.loads(out.read_text())
    assert len(result["cases"]) == len(bench.TINY)
    for row in result["cases"]:
        assert row["agrees"], row["rel_err"]
        assert set(row["contenders"]) == {"veomni_sdpa", "hf_sdpa_mask"}
        for times in row["contenders"].values():
            assert times["ms"] > 0 and times["fwd_ms"] > 0
        assert row["docs"] >= 2 and row["score_ratio_mask_vs_segments"] > 1
        assert row["speedup_fwd_bwd"] > 0


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN gradient: a contender whose output is right and whose dq is broken."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


def test_a_nan_gradient_does_not_agree(monkeypatch):
    sdpa = bench.ATTENTION_FUNCTIONS["sdpa"]

    def broken(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return sdpa(_NanGradient.apply(q), k, v, **kwargs)

    monkeypatch.setitem(bench.ATTENTION_FUNCTIONS, "sdpa", broken)
    row = bench.run_case(*bench.TINY[0], reps=1)
    assert row["rel_err"]["out"] < 1e-5 and math.isnan(row["rel_err"]["dq"])
    assert row["agrees"] is False
