"""The omni quickstart (``veomni-train quickstart-omni``): the shipped recipe through the CLI on CPU; the export
loads in plain transformers and names the pitch of tones it never heard (so it listens: the question does not give
the answer away); the assets are small and what the script writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from veomni.train.recipe import ASSETS_DIR

ROOT = Path(__file__).parents[2]
ASSETS = Path(ASSETS_DIR) / "quickstart_omni"
PITCHES = ("low", "middle", "high", "very high")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qsomni") / "run"
    cmd = [sys.executable, "-m", "veomni.train.cli", "quickstart-omni", f"--checkpoint.dir={out}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "hf"


def _answer_logprob(model, encoder, row: dict, answer: str) -> float:
    from veomni.train.data.encode import Sample
    from veomni.train.data.multimodal_batch import collate_multimodal
    from veomni.train.data.sources import RowRef

    row = {"messages": [row["messages"][0], {"role": "assistant", "content": answer}]}
    ids, trained, media = encoder(row, RowRef("eval.jsonl", 0, 1))
    batch = collate_multimodal([Sample(ids, trained, 0, media=media)])
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]),
            input_features=batch["input_features"], feature_attention_mask=batch["feature_attention_mask"],
        ).logits[0]  # fmt: skip
    labels = batch["labels"][0]
    keep = labels != -100
    return float(torch.log_softmax(logits[keep], -1).gather(-1, labels[keep, None]).sum())


@pytest.mark.slow  # slow tier: the whole quickstart recipe through the CLI
def test_export_names_the_pitch_of_unheard_tones(exported):
    from test_multimodal_data import model_data
    from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

    from veomni.train.data.build import encoder_for
    from veomni.train.recipe import load_recipe

    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(exported).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    data = load_recipe("quickstart-omni").data
    encoder = encoder_for(data, tokenizer, **model_data(model.config))
    rows = [json.loads(line) for line in (ASSETS / "eval.jsonl").read_text().splitlines()]
    right = 0
    for row in rows:
        truth = row["messages"][1]["content"]
        scores = {p: _answer_logprob(model, encoder, row, f"A {p} tone.") for p in PITCHES}
        right += f"A {max(scores, key=scores.get)} tone." == truth
    assert right >= 0.75 * len(rows), f"{right}/{len(rows)} pitches named (chance: 1/4)"


def test_assets_are_what_the_script_writes(tmp_path):
    # In process, as for the VLM assets: a fresh interpreter's imports were most of this test's time.
    spec = importlib.util.spec_from_file_location(
        "make_quickstart_omni_data", ROOT / "tools" / "make_quickstart_omni_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    for name in (
        "train.jsonl",
        "eval.jsonl",
        "processor/preprocessor_config.json",
        "processor/tokenizer.json",
    ):
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), name
    import soundfile

    for clip in sorted((ASSETS / "audio").iterdir())[:5]:
        ours, rate = soundfile.read(clip)
        fresh, _ = soundfile.read(tmp_path / "audio" / clip.name)
        assert rate == 8000 and (ours == fresh).all(), clip.name
    assert sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file()) < 600_000
