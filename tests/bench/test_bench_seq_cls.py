"""Smoke and parity test of tools/bench/bench_seq_cls.py on CPU: the Qwen3 classifier, ours vs HF, shared weights.

``--size tiny`` runs in fp32, so every contender must match transformers' classifier to float rounding (loss,
logits, checked gradients). The Triton contender is left out here (Triton's interpreter makes timed repetitions
slow); its parity with the kernels bound is tests/models/test_seq_cls_decoder.py.
"""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

bench = load_bench("bench_seq_cls.py")


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_tiny_run_matches_hf_and_reports_every_field(tmp_path):
    out = tmp_path / "seq_cls.json"
    returned = bench.main(
        ["--size", "tiny", "--layers", "1", "--reps", "2", "--contenders", "hf,veomni_decoder_eager",
         "--out", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    assert result["dtype"] == "float32" and result["shape"]["layers"] == 1
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == ["hf", "veomni_decoder_eager"]
    assert rows["hf"]["decoder_class"] == "transformers.models.qwen3.modeling_qwen3.Qwen3Model"
    ours = rows["veomni_decoder_eager"]
    assert ours["decoder_class"].startswith("veomni.models.qwen3.generated.")
    assert ours["ops"]["cross_entropy"] == "triton" and ours["ops"]["rms_norm"] == "eager"
    for row in rows.values():
        assert row["reference"] == "hf" and row["agrees"] is True
        assert max(row["errors"].values()) < 1e-5, row["errors"]
        assert row["ms"] > 0 and row["fwd_ms"] > 0 and row["peak_extra_mib"] is None
        tokens = result["shape"]["batch"] * result["shape"]["seq_len"]
        assert row["tokens_per_s"] == pytest.approx(tokens / (row["ms"] / 1e3))
    assert ours["speedup_vs_hf"] == pytest.approx(rows["hf"]["ms"] / ours["ms"])


def test_unknown_contender_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--size", "tiny", "--contenders", "hf,liger", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_contenders_without_hf_run_against_the_first_one(tmp_path):
    # Without hf in --contenders, the first contender is the reference and no speed-up against HF is reported
    # (this used to index the empty row list before the first row was appended).
    result = bench.main(
        ["--size", "tiny", "--layers", "1", "--reps", "1", "--contenders", "veomni_decoder_eager",
         "--out", str(tmp_path / "s.json")]
    )  # fmt: skip
    (row,) = result["rows"]
    assert "error" not in row, row.get("error")
    assert row["reference"] == "veomni_decoder_eager" and row["agrees"] is True
    assert "speedup_vs_hf" not in row
