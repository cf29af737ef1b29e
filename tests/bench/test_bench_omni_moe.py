"""Smoke and parity test of tools/bench/bench_omni_moe.py on CPU: the batch's placeholders follow the thinker's own
token rule and grids, and a tiny thinker's first loss is the same for veomni and plain transformers (same weights,
same batch: a contender that dropped the audio or the pixels would start elsewhere)."""

from __future__ import annotations

import json

import pytest
import torch
from bench_loader import load_bench

bench = load_bench("bench_omni_moe.py")


def test_batch_placeholders_match_the_token_rule_and_grids():
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    args = bench.parse_args(["--out", "unused.json", "--tiny", "--rows", "2"])
    config = bench.thinker_config(args)
    batch = bench.mixed_batch(config, args, torch.device("cpu"))
    frames = batch["input_features"].shape[-1]
    # --tiny numbers the released placeholders from the top of its small vocabulary, order and spacing kept.
    audio, image = config.audio_token_id, config.image_token_id
    assert (audio, image) == (bench.AUDIO - bench.TINY_SHIFT, bench.IMAGE - bench.TINY_SHIFT)
    assert bench.A_END - bench.TINY_SHIFT < config.text_config.vocab_size == bench.TINY_VOCAB
    for ids in batch["input_ids"]:
        assert ids.numel() == args.seq_len
        assert int((ids == audio).sum()) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))
        assert int((ids == image).sum()) == args.image_side**2 // 4
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert not bool((batch["labels"] >= audio - 1).any())


@pytest.mark.slow
def test_tiny_contenders_start_from_the_same_loss(tmp_path):
    out = tmp_path / "omni_moe.json"
    bench.main(["--out", str(out), "--tiny", "--steps", "1", "--warmup", "0"])
    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert not [r for r in rows.values() if "error" in r], rows
    assert rows["veomni"]["experts_implementation"] == "veomni"
    assert rows["veomni"]["first_loss"] == pytest.approx(
        rows["hf"]["first_loss"], rel=1e-3
    )  # bf16 parameters
    assert result["speedup_vs_hf"] > 0


def test_unknown_contenders_are_refused_before_anything_runs(capsys):
    # Refused by the parser, not by the loader after the earlier contenders ran (its SystemExit is no Exception,
    # so it ended the run before the JSON was written).
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--contenders", "veomni,hf_grouped_mmm"])
    assert "hf_grouped_mmm" in capsys.readouterr().err
    assert bench.parse_args(["--out", "x.json", "--contenders", "veomni,hf,hf_grouped_mm"]).contenders == [
        "veomni", "hf", "hf_grouped_mm",
    ]  # fmt: skip
