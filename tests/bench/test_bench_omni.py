"""Smoke and parity test of tools/bench/bench_omni.py on CPU: with the trainer's inputs (host positions, the
towers' host tables) and with HF's batch, a tiny Qwen2.5-Omni thinker starts from the same loss as plain
transformers, also with a video whose audio track is interleaved with its frames."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_bench

bench = load_bench("bench_omni.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--veomni-inputs", "trainer", "--contenders", "veomni,veomni_towers_eager,hf"],
        ["--veomni-inputs", "processor", "--rounds", "2"],
        ["--video-frames", "4", "--video-side", "4", "--audio-in-video", "--seq-len", "700"],
    ],
    ids=["trainer", "processor", "audio_in_video"],
)
def test_tiny_contenders_start_from_the_same_loss(tmp_path, extra):
    out = tmp_path / "omni.json"
    bench.main(["--out", str(out), "--tiny", "--steps", "1", "--warmup", "0", *extra])
    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["rows"]}  # the last round's row of each
    assert not [r for r in rows.values() if "error" in r], rows
    for name in rows.keys() - {"hf"}:
        assert rows[name]["first_loss"] == pytest.approx(rows["hf"]["first_loss"], rel=1e-4), name
    assert result["speedup_vs_hf"] > 0 and set(result["speedups_vs_hf"]) == rows.keys() - {"hf"}
    rounds = int(extra[extra.index("--rounds") + 1]) if "--rounds" in extra else 1
    assert sorted({r["round"] for r in result["rows"]}) == list(range(rounds))
    for name, best in result["best"].items():  # each contender's fastest round is the one the ratios use
        assert best == min(r["median_step_ms"] for r in result["rows"] if r["contender"] == name)


def test_unknown_contenders_are_named():
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--contenders", "veomni,hf,veomni_towers_compiled"])
