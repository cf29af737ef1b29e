"""Smoke and parity tests of tools/bench/bench_sp.py on 2 CPU ranks (gloo): the tiny Qwen3, SP=2 against SP=1.

Why the comparisons are exact. Both SP degrees build the model from the same seed on the same FSDP mesh size
(dp_shard * sp = 2), so they start from identical weights. Documents are seeded by (seed, step, dp rank): SP=2
(dp=1) trains dp rank 0's document, and so does SP=1's dp rank 0, while SP=1's dp rank 1 trains another one. The
trainer's loss is the global token mean, which for SP=1 also covers dp rank 1's document, so the benchmark
reports ``seq0_losses`` too: the mean over dp rank 0's document alone, which must agree across SP degrees to fp32
rounding. With ``--same-data`` every dp rank trains dp rank 0's document, so the global loss and the gradient
(hence its norm, and every later step) must agree as well.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from bench_loader import BENCH_DIR, load_bench

SCRIPT = BENCH_DIR / "bench_sp.py"
SMOKE = ["--tiny", "--precision", "fp32", "--device", "cpu", "--steps", "2", "--warmup", "1"]


bench = load_bench("bench_sp.py")


def test_parse_sp_lengths_keeps_order_and_rejects_bad_items():
    assert bench.parse_sp_lengths("4:32768,65536;1:32768") == [(4, [32768, 65536]), (1, [32768])]
    assert bench.parse_sp_lengths(bench.DEFAULT_SP_LENGTHS)[0] == (4, [32768, 65536, 131072])
    for bad in ("", "4", "0:128", "2:1", "x:128", "2:abc"):
        with pytest.raises(ValueError, match="sp-lengths"):
            bench.parse_sp_lengths(bad)
    with pytest.raises(ValueError, match="op=backend"):
        bench.parse_ops("attention")
    assert bench.parse_ops("attention=varlen, rope=eager") == {"attention": "varlen", "rope": "eager"}


def test_sp_ratios_pair_each_sp_with_sp1_at_the_same_length():
    runs = {
        "a": {"sp": 4, "seq_len": 8, "tokens_per_s_per_gpu": 30.0, "peak_allocated_gib": 10.0},
        "b": {"sp": 4, "seq_len": 16, "tokens_per_s_per_gpu": 20.0},
        "c": {"sp": 1, "seq_len": 8, "tokens_per_s_per_gpu": 60.0, "peak_allocated_gib": 40.0},
        "d": {"sp": 1, "seq_len": 16, "error": "OutOfMemoryError"},
    }
    assert bench.sp_ratios(runs) == {
        "sp4/sp1@8": {"sp": 4, "seq_len": 8, "tokens_per_s_per_gpu": 0.5, "peak_allocated_gib": 0.25}
    }


def test_documents_and_sp_slices_follow_the_trainer_layout():
    doc = bench.document(0, 3, 1, 64, 50)
    assert (doc.input_ids == bench.document(0, 3, 1, 64, 50).input_ids).all()
    assert not (doc.input_ids == bench.document(0, 3, 0, 64, 50).input_ids).all()  # dp ranks differ
    assert not (doc.input_ids == bench.document(0, 4, 1, 64, 50).input_ids).all()  # steps differ
    assert doc.num_trained == 63 and not doc.trained[0]
    whole = bench.collate([doc])
    parts = [bench.collate([doc], sp_rank=r, sp_size=2) for r in range(2)]
    for key in ("input_ids", "labels", "position_ids"):
        joined = np.concatenate([p[key][0].numpy() for p in parts])
        assert joined.tolist() == whole[key][0].tolist(), key
    assert whole["labels"][0, :-1].tolist() == doc.input_ids[1:].tolist() and whole["labels"][0, -1] == -100
    assert parts[1]["cu_seqlens"].tolist() == [0, 64]  # one document, described over the full row
    assert sum(int(p["num_valid_tokens"]) for p in parts) == 63


def _check_records(result: dict, same_data: bool) -> tuple[dict, dict]:
    sp2, sp1 = result["runs"]["sp2_seq256"], result["runs"]["sp1_seq256"]
    for r in (sp2, sp1):
        assert "error" not in r, r.get("error")
        assert len(r["losses"]) == len(r["seq0_losses"]) == len(r["grad_norms"]) == 3
        assert all(math.isfinite(x) for x in r["losses"] + r["seq0_losses"] + r["grad_norms"])
        assert len(r["step_s"]) == 2 and r["tokens_per_s_per_gpu"] > 0 and r["mfu"] is None  # no peak on CPU
        assert r["model_steps_before"] == 0 and r["flops_per_step"] > 0
    assert (sp2["sp"], sp2["dp"], sp2["tokens_per_step"]) == (2, 1, 256)
    assert (sp1["sp"], sp1["dp"], sp1["tokens_per_step"]) == (1, 2, 512)
    # Same weights, same document on dp rank 0: the step-0 loss over that document agrees to fp32 rounding.
    assert sp2["seq0_losses"][0] == pytest.approx(sp1["seq0_losses"][0], rel=1e-5)
    assert sp2["losses"][0] == pytest.approx(sp2["seq0_losses"][0], rel=1e-6)  # dp=1: one document
    if not same_data:
        assert sp1["losses"][0] != pytest.approx(sp1["seq0_losses"][0], rel=1e-6)  # dp rank 1 had another
    ratio = result["ratios"]["sp2/sp1@256"]
    assert ratio["tokens_per_s_per_gpu"] == pytest.approx(
        sp2["tokens_per_s_per_gpu"] / sp1["tokens_per_s_per_gpu"]
    )
    assert result["longest_sp1_fit"] == 256 and "sp2/sp1@256" in result["at_longest_sp1_fit"]
    return sp2, sp1


@pytest.mark.slow
def test_torchrun_smoke_sp2_and_sp1_agree_on_dp_rank0_document(tmp_path):
    out = tmp_path / "sp.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
        "--out", str(out), *SMOKE, "--sp-lengths", "2:256;1:256",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in (
        "command",
        "torch",
        "transformers",
        "device",
        "world_size",
        "model",
        "settings",
        "mfu_convention",
    ):
        assert key in result, key
    assert result["world_size"] == 2 and result["settings"]["activation_checkpointing"] is True
    assert "random init" in result["model"]["weights"]
    sp2, _ = _check_records(result, same_data=False)
    assert sp2["ops"]["attention"] == "sdpa" and sp2["attn_implementation"] == "veomni_sdpa"
    assert "sp2_seq256" in proc.stdout and "tok/s/GPU" in proc.stdout  # the table on rank 0


def _bench_task(ctx, argv: list[str]) -> dict:
    return load_bench("bench_sp.py").main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_same_data_sp2_matches_sp1_step_for_step(dist_pools, tmp_path, ac):
    out = str(tmp_path / "sp.json")
    common = [*SMOKE, "--same-data", "--out", out] + ([] if ac else ["--no-ac"])
    pool = dist_pools.get(2, "gloo")
    results = pool.run(_bench_task, [*common, "--sp-lengths", "2:256;1:256"])
    assert json.loads((tmp_path / "sp.json").read_text()) == json.loads(json.dumps(results[0]))
    sp2, sp1 = _check_records(results[0], same_data=True)
    # fp32 throughout, the same data on every dp rank: any difference beyond rounding is an SP (or activation
    # checkpointing) bug in the forward, the backward, the loss normalisation or the optimizer step.
    assert sp2["losses"] == pytest.approx(sp1["losses"], rel=1e-5)
    assert sp2["grad_norms"] == pytest.approx(sp1["grad_norms"], rel=1e-4)
    if not ac:
        # --append: a second command adds its configurations to the first one's JSON (ratios over both).
        more = pool.run(_bench_task, [*common, "--append", "--sp-lengths", "1:128"])
        merged = json.loads((tmp_path / "sp.json").read_text())
        assert merged == json.loads(json.dumps(more[0]))
        assert sorted(merged["runs"]) == ["sp1_seq128", "sp1_seq256", "sp2_seq256"]
        assert merged["runs"]["sp2_seq256"] == results[0]["runs"]["sp2_seq256"]
        assert merged["earlier_commands"] == [results[0]["command"]] and merged["longest_sp1_fit"] == 256


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_hybrid_model_sp2_matches_sp1_and_counts_attention_layers_only(dist_pools, tmp_path):
    # --model qwen3_5_9b --tiny: Gated DeltaNet layers under Ulysses SP (heads split, recurrence whole) through the
    # benchmark's own trainer path; the quadratic FLOPs term counts the one full-attention layer of the four.
    out = str(tmp_path / "hybrid.json")
    argv = [*SMOKE, "--model", "qwen3_5_9b", "--same-data", "--no-ac", "--out", out, "--sp-lengths", "2:256;1:256"]
    result = dist_pools.get(2, "gloo").run(_bench_task, argv)[0]
    assert result["model"]["config"]["model_type"] == "qwen3_5_text"
    sp2, sp1 = _check_records(result, same_data=True)
    assert sp2["losses"] == pytest.approx(sp1["losses"], rel=1e-5)
    assert sp2["grad_norms"] == pytest.approx(sp1["grad_norms"], rel=1e-4)
    width = 4 * 16  # heads x head_dim of the tiny config
    attention = 6.0 * 1 * width * 256**2  # one full-attention layer, one 256-token document per SP group
    assert sp2["attention_layers"] == 1 and sp2["ops"]["gated_delta_rule"] == "eager"
    assert sp2["flops_per_step"] - attention == pytest.approx(256 * sp2["flops_per_token_matmul"])


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_one_rank_bf16_trains_the_master_weights(tmp_path):
    # One process in bf16 takes the trainer's master-weights path (a bf16 module over fp32 masters): the optimizer
    # must step the masters, as build_run builds it (an optimizer over the bf16 module was refused by build_adamw).
    out = str(tmp_path / "one.json")
    argv = ["--tiny", "--device", "cpu", "--steps", "2", "--warmup", "0", "--sp-lengths", "1:64", "--lr", "1e-2"]
    result = bench.main([*argv, "--same-data", "--no-ac", "--out", out])
    run = result["runs"]["sp1_seq64"]
    assert "error" not in run, run.get("error")
    assert (run["sp"], run["dp"], run["training_path"]) == (1, 1, "master_weights")
    assert all(math.isfinite(n) and n > 0 for n in run["grad_norms"])
