"""What a new user does first: point the quickstart at their own files. The defaults must not bite, and a
whole-file mistake is one line about the file, not a row-level hint that leads nowhere."""

from __future__ import annotations

import json

from data_helpers import write_parquet

from veomni.train.cli import main
from veomni.train.recipe import ASSETS_DIR

SHORT = [
    "--train.steps=2", "--train.epochs=null", "--optim.warmup_steps=1", "--train.eval_interval=null", "--data.eval_files=[]",
    "--checkpoint.hf_export=false", "--checkpoint.save_final=false",
]  # fmt: skip


def _quickstart_rows_as_parquet(tmp_path):
    rows = [json.loads(line) for line in (ASSETS_DIR / "quickstart" / "train.jsonl").read_text().splitlines()]
    return write_parquet(tmp_path / "train.parquet", rows[:64])


def test_the_quickstart_trains_on_a_parquet_file_given_on_the_command_line(tmp_path, capsys):
    data = _quickstart_rows_as_parquet(tmp_path)
    code = main(["quickstart", f"--data.train_files=[{data}]", f"--checkpoint.dir={tmp_path / 'run'}", *SHORT])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "done: 2 steps" in capsys.readouterr().out


def test_a_parquet_file_read_as_jsonl_is_one_line_about_the_file(tmp_path, capsys):
    data = _quickstart_rows_as_parquet(tmp_path)
    code = main([
        "quickstart", f"--data.train_files=[{data}]", "--data.format=jsonl",
        f"--checkpoint.dir={tmp_path / 'run'}", *SHORT,
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert f"{data}: read as jsonl (data.format), but the file holds a parquet file" in err
    assert "on_bad_row" not in err and "line 1" not in err and "Traceback" not in err
