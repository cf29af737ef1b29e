"""tools/bench/bench_dit_sp.py on 2 gloo ranks: a tiny Wan I2V DiT at SP = 2 and SP = 1.

Both degrees build the same seeded weights on a 2-rank FSDP mesh, and dp rank 0 trains the same first sample in
both, so the first step's loss (each rank's own sample) must agree to fp32 rounding; SP = 1's two dp ranks train
two samples, so the later steps differ by design.
"""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

bench = load_bench("bench_dit_sp.py")


def test_sp_degrees_default_halves_down_to_one_and_checks_divisibility():
    assert bench.sp_degrees(None, 4) == [4, 2, 1]
    assert bench.sp_degrees("2,1", 2) == [2, 1]
    with pytest.raises(ValueError, match="must divide the world size 4"):
        bench.sp_degrees("3", 4)
    assert bench.tokens_per_sample("i2v_14b", (21, 60, 104)) == 21 * 30 * 52
    assert bench.parse_args(["--out", "x", "--size", "t2v_1_3b", "--latent", "21,90,160"]).latent == (21, 90, 160)
    assert bench.parse_args(["--out", "x", "--size", "t2v_1_3b"]).latent == (21, 60, 104)
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--latent", "21,90"])


def _bench_task(ctx, argv: list[str]) -> dict:
    return load_bench("bench_dit_sp.py").main(argv)


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_tiny_i2v_sp2_and_sp1_start_from_the_same_loss(dist_pools, tmp_path):
    out = tmp_path / "dit_sp.json"
    argv = ["--out", str(out), "--size", "tiny", "--device", "cpu", "--sp", "2,1", "--steps", "1", "--warmup", "1",
            "--precision", "fp32"]  # fmt: skip
    results = dist_pools.get(2, "gloo").run(_bench_task, argv)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(results[0]))
    sp2, sp1 = written["runs"]
    assert (sp2["sp"], sp2["dp"], sp1["sp"], sp1["dp"]) == (2, 1, 1, 2), written["runs"]
    assert "error" not in sp2 and "error" not in sp1
    assert sp2["losses"][0] == pytest.approx(sp1["losses"][0], rel=1e-5)
    assert sp2["samples_per_s"] > 0 and sp2["tokens_per_s_per_gpu"] > 0
