"""Smoke and parity test of tools/bench/bench_e2e.py on CPU: the tiny Qwen3, veomni against plain HF.

Both contenders load the same saved weights and train on the same packed batches, so their first-step losses
must agree (bf16 compute: to bf16 rounding; fp32: to float rounding, every step and grad norm). The timing
columns are only checked for sanity here; the numbers that matter come from a GPU run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from bench_loader import BENCH_DIR, load_bench

SCRIPT = BENCH_DIR / "bench_e2e.py"


bench = load_bench("bench_e2e.py")

SMOKE = ["--tiny", "--steps", "2", "--warmup", "1", "--seq-len", "128", "--device", "cpu"]


def test_packed_batches_restart_positions_and_shift_labels_per_document():
    batches = bench.packed_batches(3, 96, vocab=50, min_doc=5, max_doc=40, seed=7)
    assert len(batches) == 3
    for b in batches:
        ids, pos, labels = (b[k][0].numpy() for k in ("input_ids", "position_ids", "labels"))
        lens = b["doc_lens"]
        assert sum(lens) == 96 and len(lens) >= 3 and all(n >= 1 for n in lens)
        assert all(5 <= n <= 40 for n in lens[:-1])  # the last document is cut to fill the row
        assert b["cu_seqlens"].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
        assert b["max_seqlen"] == max(lens)
        start = 0
        for n in lens:
            assert pos[start : start + n].tolist() == list(range(n))
            assert labels[start : start + n - 1].tolist() == ids[start + 1 : start + n].tolist()
            assert labels[start + n - 1] == -100  # no label crosses a document boundary
            start += n
        assert b["num_valid"] == int((labels != -100).sum()) == 96 - len(lens)
    again = bench.packed_batches(3, 96, vocab=50, min_doc=5, max_doc=40, seed=7)
    assert all(
        (a["input_ids"] == b["input_ids"]).all() and a["doc_lens"] == b["doc_lens"]
        for a, b in zip(batches, again, strict=True)
    )
    other = bench.packed_batches(1, 96, vocab=50, min_doc=5, max_doc=40, seed=8)
    assert not (other[0]["input_ids"] == batches[0]["input_ids"]).all()


def test_bad_arguments_name_the_choices(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--contenders", "veomni,megatron"])
    assert "megatron" in capsys.readouterr().err
    with pytest.raises(ValueError, match="op=backend"):
        bench.parse_ops("attention")


@pytest.mark.slow
def test_smoke_veomni_and_hf_start_equal(tmp_path):
    out = tmp_path / "e2e.json"
    returned = bench.main([*SMOKE, "--contenders", "veomni,hf", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    ours, hf = result["contenders"]["veomni"], result["contenders"]["hf"]
    for r in (ours, hf):
        assert "error" not in r, r.get("error")
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
        assert r["tokens_per_s_per_gpu"] > 0 and len(r["step_s"]) == 2
    assert ours["attn_implementation"] == "veomni_sdpa" and hf["attn_implementation"] == "sdpa"
    # Same weights, same data, bf16 compute on both sides: step 0 (no update yet) agrees to bf16 rounding.
    assert ours["losses"][0] == pytest.approx(hf["losses"][0], rel=1e-4)
    assert ours["grad_norms"][0] == pytest.approx(hf["grad_norms"][0], rel=1e-2)
    assert result["ratios"]["veomni/hf"]["tokens_per_s"] == pytest.approx(
        ours["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"]
    )


@pytest.mark.slow
def test_fp32_runs_match_step_for_step(tmp_path):
    result = bench.main(
        [*SMOKE, "--contenders", "veomni,hf", "--precision", "fp32", "--out", str(tmp_path / "e2e.json")]
    )
    ours, hf = result["contenders"]["veomni"], result["contenders"]["hf"]
    # fp32 throughout: any difference beyond float rounding is a real mismatch (weights, data, loss
    # normalisation, packing, optimizer groups or clipping).
    assert ours["losses"] == pytest.approx(hf["losses"], rel=1e-5)
    assert ours["grad_norms"] == pytest.approx(hf["grad_norms"], rel=1e-4)
    assert ours["losses"][-1] != ours["losses"][0]  # the optimizer did step


def test_compile_is_chosen_by_contender_not_ops_override(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--veomni-ops", "compile=on"])
    assert "veomni_compiled" in capsys.readouterr().err
    args = bench.parse_args(["--out", "x.json"])
    assert {"veomni_compiled", "veomni_plain_compiled"} <= set(args.contenders)


@pytest.mark.slow
def test_compiled_contender_matches_eager_without_recompiles(tmp_path):
    # fp32 throughout, so compiled (inductor's CPU code around the same kernels) and eager blocks agree to float
    # rounding; the micro-batches hold different document counts, which must not recompile after warm-up.
    result = bench.main(
        [
            *SMOKE,
            "--contenders",
            "veomni,veomni_compiled",
            "--precision",
            "fp32",
            "--out",
            str(tmp_path / "e.json"),
        ]
    )
    eager, compiled = result["contenders"]["veomni"], result["contenders"]["veomni_compiled"]
    assert "error" not in compiled, compiled.get("error")
    assert len(set(result["data"]["docs_per_micro_batch"])) > 1
    assert eager["compiled_blocks"] is False and eager["ops"]["compile"] == "off"
    assert compiled["compiled_blocks"] is True and compiled["ops"]["compile"] == "on"
    assert compiled["compile_backend"] == "inductor" and compiled["compile_s"] > 0
    assert compiled["graphs_compiled"] >= 1 and compiled["recompiles_after_warmup"] == 0
    assert compiled["first_step_s"] > compiled["median_step_ms"] / 1e3  # the first step paid for compiling
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["grad_norms"] == pytest.approx(eager["grad_norms"], rel=1e-4)
    assert "veomni_compiled/veomni" in result["ratios"]


def test_no_reshard_needs_fsdp2(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--veomni-no-reshard"])
    assert "--veomni-fsdp2" in capsys.readouterr().err
    assert bench.parse_args(["--out", "x.json", "--veomni-no-reshard", "--veomni-fsdp2"]).veomni_fsdp2


@pytest.mark.slow
def test_veomni_master_weights_equal_fsdp2_mixed_precision(tmp_path):
    # The default veomni contender (one rank: bf16 module over fp32 masters) and --veomni-fsdp2 (FSDP2 mixed
    # precision on a one-rank mesh) run the same arithmetic: identical losses and grad norms, bf16 on CPU.
    args = [*SMOKE, "--contenders", "veomni", "--grad-accum", "2"]
    ours = bench.main([*args, "--out", str(tmp_path / "m.json")])["contenders"]["veomni"]
    fsdp = bench.main([*args, "--veomni-fsdp2", "--out", str(tmp_path / "f.json")])["contenders"]["veomni"]
    assert "master weights" in ours["precision"] and "FSDP2" in fsdp["precision"]
    assert ours["losses"] == fsdp["losses"]
    assert ours["grad_norms"] == fsdp["grad_norms"]
