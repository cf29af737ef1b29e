"""Smoke and parity test of tools/bench/bench_moe_e2e.py: the tiny Qwen3-MoE on 2 gloo ranks (EP=2), fp32.

Both contenders load the same saved weights and train on the same per-rank packed batches, so the LM loss of
step 0 (before any update) must agree to float rounding. Later steps and grad norms agree closely but not
exactly: HF's Trainer convention scales the whole loss, aux term included, by the world size, while veomni's
loop weights the aux loss by 1/dp. The timing columns are only checked for sanity; the numbers that matter come
from the 4-GPU run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from bench_loader import BENCH_DIR, load_bench

SCRIPT = BENCH_DIR / "bench_moe_e2e.py"
SMOKE = [
    "--tiny",
    "--device",
    "cpu",
    "--precision",
    "fp32",
    "--tokens",
    "256",
    "--steps",
    "2",
    "--warmup",
    "1",
]


def test_bad_arguments_are_refused(capsys):
    bench = load_bench("bench_moe_e2e.py")
    for bad in (["--layers", "49"], ["--contenders", "veomni,megatron"], ["--tokens", "4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x.json", *bad])
    err = capsys.readouterr().err
    assert "1..48" in err and "megatron" in err and "--tokens >= 16" in err
    assert bench.parse_args(["--out", "x.json"]).layers == 16  # the documented default depth
    config = bench.moe_config(tiny=False, layers=16)
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim, config.num_hidden_layers) == (
        128, 8, 128, 16,
    )  # fmt: skip


@pytest.mark.slow
def test_smoke_two_gloo_ranks_veomni_and_hf_start_equal(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--out", str(out), *SMOKE]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "veomni/hf: tok/s/gpu x" in proc.stdout  # rank 0 printed the table
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["layers"] == 2 and result["config"]["num_experts"] == 8
    assert {"torch", "transformers", "triton", "python"} <= set(result["versions"])
    ours, hf = result["contenders"]["veomni"], result["contenders"]["hf"]
    for r in (ours, hf):
        assert "error" not in r, r.get("error")
        assert len(r["losses"]) == len(r["grad_norms"]) == 3 and len(r["step_s"]) == 2
        assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * 256 / sum(r["step_s"]))
        assert r["mfu"] is None  # no peak FLOP/s on the CPU
        assert len(r["step_s_per_rank"]) == 2
    assert ours["parallel"]["ep"] == 2 and ours["ops"]["moe_experts"] == "torch"
    assert ours["experts_implementation"].startswith("veomni") and ours["attn_implementation"].startswith(
        "veomni"
    )
    assert hf["experts_implementation"] in ("grouped_mm", "batched_mm", "eager")  # HF's own, recorded
    assert hf["attn_implementation"] == "sdpa"
    # Same weights and data, fp32: step 0's LM loss agrees to float rounding (a wrong weight, label shift,
    # per-rank batch or loss normalisation moves it far more).
    assert ours["losses"][0] == pytest.approx(hf["losses"][0], rel=1e-5)
    assert ours["grad_norms"][0] == pytest.approx(hf["grad_norms"][0], rel=1e-3)
    assert ours["losses"] == pytest.approx(hf["losses"], rel=1e-4)
    assert ours["losses"][-1] != ours["losses"][0]  # the optimizer did step
    # The LM head as its own FSDP unit or in the root: the same run to float rounding.
    in_root = result["contenders"]["veomni_head_in_root"]
    assert ours["lm_head_unit"] is True and in_root["lm_head_unit"] is False
    assert in_root["losses"] == pytest.approx(ours["losses"], rel=1e-6)
    assert in_root["grad_norms"] == pytest.approx(ours["grad_norms"], rel=1e-5)
    assert set(result["ratios"]) == {"veomni/hf", "veomni/veomni_head_in_root"}
    # The Switch load-balancing loss of near-uniform routing is about top_k (3 here): it was computed.
    assert all(abs(a - 3.0) < 0.5 for a in hf["aux_losses_rank_mean"])
    # Each step's global label count: 2 ranks x 256 tokens, minus each document's last token.
    docs = result["data"]["docs_per_rank_per_step"]
    assert result["data"]["valid_labels_per_step_all_ranks"] == [2 * 256 - sum(d) for d in docs]
    assert result["ratios"]["veomni/hf"]["tokens_per_s_per_gpu"] == pytest.approx(
        ours["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"]
    )


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_one_rank_bf16_veomni_trains_the_master_weights(tmp_path):
    # One process in bf16 takes the trainer's master-weights path: the optimizer must step the fp32 masters (as
    # build_run builds it); an optimizer over the bf16 module was refused by build_adamw.
    bench = load_bench("bench_moe_e2e.py")
    argv = ["--tiny", "--device", "cpu", "--tokens", "64", "--steps", "1", "--warmup", "1", "--contenders", "veomni"]
    result = bench.main([*argv, "--out", str(tmp_path / "one.json")])
    ours = result["contenders"]["veomni"]
    assert "error" not in ours, ours.get("error")
    assert len(ours["losses"]) == 2 and all(math.isfinite(n) and n > 0 for n in ours["grad_norms"])
    assert "master weights" in ours["precision"]
