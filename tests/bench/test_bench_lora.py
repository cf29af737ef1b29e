"""Smoke and parity test of tools/bench/bench_lora.py on CPU: the tiny Qwen3, veomni's LoRA against HF + PEFT.

Both contenders load the same bf16 base and start from zero B matrices, so their first-step losses agree to bf16
rounding; the adapters train in both (the loss moves). Timing columns are only checked for sanity here.
"""

from __future__ import annotations

import json
import math

import pytest
from bench_loader import load_bench

bench = load_bench("bench_lora.py")


@pytest.mark.slow
def test_tiny_smoke_runs_both_contenders_from_the_same_start(tmp_path):
    out = tmp_path / "lora.json"
    bench.main(["--out", str(out), "--tiny", "--seq-len", "128", "--steps", "2", "--warmup", "1", "--device", "cpu",
                "--contenders", "veomni_lora,hf_peft"])  # fmt: skip
    result = json.loads(out.read_text())
    ours, peer = result["results"]["veomni_lora"], result["results"]["hf_peft"]
    assert "error" not in ours and "error" not in peer, (ours.get("error"), peer.get("error"))
    assert math.isclose(ours["losses"][0], peer["losses"][0], rel_tol=2e-3)
    assert ours["losses"][-1] != ours["losses"][0] and peer["losses"][-1] != peer["losses"][0]
    assert ours["lora"]["trained_params"] == peer["lora"]["trained_params"]
    assert result["ratios"]["veomni_lora/hf_peft"]["tokens_per_s"] > 0
