"""Smoke and parity test of tools/bench/bench_sink_attention.py on CPU: veomni's sink backends vs HF's gpt-oss eager.

``--size tiny`` runs fp32 on the CPU, where every backend that runs must equal the fp32 reference (transformers'
gpt-oss eager formula) to float rounding in the output and all four gradients, with sliding windows and packed
documents; flex (no CPU backward) must be skipped with the reason.
"""

from __future__ import annotations

import json

import pytest
import torch
from bench_loader import load_bench

bench = load_bench("bench_sink_attention.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sinks") / "sinks.json"
    returned = bench.main(["--size", "tiny", "--seqs", "64", "--reps", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    return result


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_tiny_backends_match_hf_eager(tiny):
    configs = tiny["configs"]
    assert [(c["layer"], c["packed"]) for c in configs] == [
        ("sliding", False), ("sliding", True), ("full", False), ("full", True),
    ]  # fmt: skip
    assert tiny["shape"] == {"q_heads": 8, "kv_heads": 2, "head_dim": 16, "window": 8}
    assert "sinks" in tiny["backends_without_sinks"]["varlen"]
    for c in configs:
        assert sum(c["doc_lens"]) == 64 and (len(c["doc_lens"]) > 1) == c["packed"]
        assert c["window"] == (8 if c["layer"] == "sliding" else None)
        rows = {r["impl"]: r for r in c["rows"]}
        assert c["rows"][0]["impl"] == "hf_eager"
        assert {"hf_eager", "veomni_eager", "veomni_sdpa"} <= {n for n, r in rows.items() if "ms" in r}
        assert "needs cuda" in rows["veomni_flex"]["skipped"]
        for name, r in rows.items():
            if "ms" not in r:
                continue
            assert set(r["errors"]) == {"out", "dq", "dk", "dv", "dsinks"}
            for tensor, err in r["errors"].items():
                assert err["max_abs"] < 1e-5, (c["layer"], c["packed"], name, tensor, err)
            assert r["ms"] > 0 and r["fwd_ms"] > 0 and r["peak_extra_mib"] is None and r["reps"] == 2
            if name != "hf_eager":
                assert r["speedup_vs_hf_eager"] == pytest.approx(rows["hf_eager"]["ms"] / r["ms"])


def test_masks_documents_and_windows():
    lengths = bench.doc_lengths(100, seed=3)
    assert sum(lengths) == 100 and all(12 <= n <= 50 for n in lengths[:-1]) and len(lengths) > 1
    assert lengths == bench.doc_lengths(100, seed=3)
    keep = bench.allowed(10, [4, 6], 3, torch.device("cpu"))
    for i in range(10):
        for j in range(10):
            same = (i < 4) == (j < 4)
            assert bool(keep[i, j]) == (same and 0 <= i - j < 3), (i, j)
    mask = bench.additive_mask(keep, torch.bfloat16)
    assert mask.shape == (1, 1, 10, 10) and mask.dtype == torch.bfloat16
    assert bool((mask[0, 0][keep] == 0).all()) and bool(
        (mask[0, 0][~keep] == torch.finfo(torch.bfloat16).min).all()
    )


def test_the_reference_sees_windows_and_sinks():
    # The parity check can fail: attention without the window, or with other sinks, is far from the reference.
    from veomni.kernels.attention import eager_attention

    spec = bench.SIZES["tiny"]
    inputs = bench.make_inputs(spec, 32, torch.float32, torch.device("cpu"))
    scale = spec["head_dim"] ** -0.5
    ref = bench.reference(inputs, bench.allowed(32, [32], 8, torch.device("cpu")), scale)
    q, k, v, sinks = (inputs[n].detach() for n in ("q", "k", "v", "sinks"))
    right = eager_attention(q, k, v, window=8, sinks=sinks, scale=scale)
    assert bench.max_abs(right, ref["out"]) < 1e-5
    assert bench.max_abs(eager_attention(q, k, v, sinks=sinks, scale=scale), ref["out"]) > 1e-2
    assert bench.max_abs(eager_attention(q, k, v, window=8, sinks=sinks + 1, scale=scale), ref["out"]) > 1e-2
