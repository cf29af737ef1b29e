"""veomni-data-preview: decoded packed batches with the loss mask visible, per-batch stats, clear errors."""

from __future__ import annotations

import io
from importlib.metadata import entry_points

import numpy as np
from data_helpers import tokenizer

from veomni.train.data.preview import main, preview, render_sample


def run(*argv: str) -> str:
    out = io.StringIO()
    preview(list(argv), out)
    return out.getvalue()


def test_preview_of_the_quickstart_training_data():
    text = run("quickstart", "--n", "3", "--samples=2", "--dp-size", "2", "--dp-rank", "1")
    assert "train data: 600 rows, 600 samples" in text
    assert "grad_accum 1 x dp 2 per step" in text
    assert text.count("\n=== step ") == 3 and "(dp rank 1, epoch 0)" in text
    assert text.count("--- sample 0: ") == 3 and "train.jsonl line " in text
    # Headers are bracketed (no loss), the assistant's words are not.
    assert "[[<|im_start|>user\n" in text and "<|im_start|>assistant\n]]" in text
    assert "more samples (--samples 0 shows all)" in text


def test_preview_eval_data_with_overrides_and_colour():
    text = run(
        "quickstart", "--eval", "--n", "1", "--samples", "0", "--color", "always", "--data.max_seq_len=64"
    )
    assert "eval data: 48 samples" in text and "2 micro-batches, 2 per rank" in text
    assert "\x1b[2m<|im_start|>" in text and "[[" not in text


def test_render_sample_brackets_untrained_runs():
    ids = tokenizer()("ab cd", add_special_tokens=False)["input_ids"] + [tokenizer().eos_token_id]
    trained = [False] + [True] * (len(ids) - 2) + [False]
    text = render_sample(tokenizer(), np.array(ids), np.array(trained), color=False)
    assert text.startswith("[[") and text.endswith("[[<|im_end|>]]") and "cd" in text


def test_errors_exit_with_status_2(capsys):
    assert main(["quickstart", "--trian.seed=1"]) == 2
    assert "unknown override --trian.seed (did you mean --train.seed?)" in capsys.readouterr().err
    assert main(["quickstart", "--n", "many"]) == 2
    assert "--n: expected int, found 'many'" in capsys.readouterr().err
    assert main([]) == 2
    assert main(["quickstart", "--dp-size", "2", "--dp-rank", "2"]) == 2
    assert "--dp-rank 2 is out of range for --dp-size 2" in capsys.readouterr().err
    assert main(["quickstart", "--samples=-1"]) == 2
    assert "--samples: expected >= 0, found -1" in capsys.readouterr().err
    assert main(["quickstart", "--help"]) == 0
    assert "--data.max_seq_len" in capsys.readouterr().out


def test_console_script_points_at_main():
    scripts = {ep.name: ep for ep in entry_points(group="console_scripts")}
    assert "veomni-data-preview" in scripts, "veomni-train is not installed; run uv sync"
    assert scripts["veomni-data-preview"].load() is main
