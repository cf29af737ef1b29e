"""Bad rows found in DataLoader workers, and one rank's failure under torchrun: one line each, exit code 2.

A truncated PNG passes the index (its header gives the size) and fails only when a worker decodes its pixels, so
with ``data.num_workers=1`` the error is raised in a worker process. Under torchrun (gloo, CPU) the row lands on
one rank; the other, blocked in a collective, stops naming it (`veomni.train.rank_failure`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from test_multimodal_data import png

from veomni.train.recipe import ASSETS_DIR

VLM_ASSETS = ASSETS_DIR / "quickstart_vlm"


def data_with_a_truncated_image(tmp_path: Path, rows: int) -> Path:
    """The quickstart_vlm rows (images relative to its assets), the first one's picture replaced by a truncated
    PNG whose header parses but whose pixels do not decode."""
    cut = tmp_path / "cut.png"
    cut.write_bytes(png(32, 32)[:120])
    lines = (VLM_ASSETS / "train.jsonl").read_text().splitlines()
    image_rows = [json.loads(line) for line in lines if '"image"' in line][:rows]
    image_rows[0]["messages"][0]["content"][0]["image"] = str(cut)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in image_rows))
    return path


def overrides(tmp_path: Path, data: Path, tokens_per_step: int) -> list[str]:
    return [
        f"--data.train_files=[{data}]", "--data.eval_files=[]", "--train.eval_interval=null",
        f"--data.media_root={VLM_ASSETS}", "--data.num_workers=1", "--data.shuffle=false", "--train.steps=2",
        "--train.epochs=null", "--optim.warmup_steps=0", f"--train.tokens_per_step={tokens_per_step}",
        "--train.tokens_per_micro_batch=512", f"--checkpoint.dir={tmp_path / 'run'}",
    ]  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    """The CLI's own lines in ``stderr`` (the rest are the run's log lines and library warnings)."""
    return [line for line in stderr.splitlines() if line.startswith("veomni-train")]


def test_a_bad_row_found_in_a_worker_exits_2_with_one_line(tmp_path):
    data = data_with_a_truncated_image(tmp_path, rows=12)
    cmd = [sys.executable, "-m", "veomni.train.cli", "quickstart_vlm", *overrides(tmp_path, data, 512)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "DataLoader worker" not in result.stderr, result.stderr[
        -3000:
    ]
    (line,) = error_lines(result.stderr)
    assert line.startswith(f"veomni-train: DataError: {data} line 1: ") and "cut.png" in line, line


def test_a_bad_row_on_one_torchrun_rank_stops_both_with_one_line_each(tmp_path):
    data = data_with_a_truncated_image(tmp_path, rows=24)
    logs = tmp_path / "logs"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--log-dir", str(logs), "--redirects", "3",
        "-m", "veomni.train.cli", "quickstart_vlm", *overrides(tmp_path, data, 1024),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0
    stderr = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(stderr) == [0, 1], result.stderr[-3000:]
    for rank, text in stderr.items():
        assert "Traceback" not in text and "Connection closed" not in text, f"rank {rank}:\n{text[-3000:]}"
        assert len(error_lines(text)) == 1, f"rank {rank}:\n{text[-3000:]}"
    lines = {rank: error_lines(text)[0] for rank, text in stderr.items()}
    failed = next(rank for rank, line in lines.items() if ": DataError: " in line)
    other = 1 - failed
    assert lines[failed].startswith(f"veomni-train (rank {failed}): DataError: {data} line 1: ")
    assert lines[other] == (
        f"veomni-train (rank {other}): stopping: rank {failed} failed: "
        f"{lines[failed].removeprefix(f'veomni-train (rank {failed}): ')}"
    )
    # torchrun's summary: both ranks exited with code 2.
    assert len(re.findall(r"exitcode\s*:\s*2\b", result.stderr)) == 2, result.stderr[-3000:]


WATCHED = """
import sys

import torch.distributed as dist

from veomni.train.data.sources import DataError
from veomni.train.rank_failure import FailureWatch, publish_failure

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    # Fails without closing its sockets: the peer's collective does not fail, only the watch can stop it.
    publish_failure(0, DataError("rows.jsonl line 3: bad"))
    print("veomni-train (rank 0): DataError: rows.jsonl line 3: bad", file=sys.stderr, flush=True)
    sys.exit(2)
FailureWatch(rank, interval=0.1).start()
dist.barrier()  # rank 0 never joins
print("rank 1 passed the barrier", file=sys.stderr, flush=True)
"""


def test_a_rank_blocked_in_a_collective_is_stopped_by_the_watch(tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    logs = tmp_path / "logs"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--log-dir", str(logs), "--redirects", "3", str(script),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0
    stderr = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    assert error_lines(stderr[1]) == [
        "veomni-train (rank 1): stopping: rank 0 failed: DataError: rows.jsonl line 3: bad"
    ], stderr[1][-3000:]
    assert "Traceback" not in stderr[1] and "passed the barrier" not in stderr[1]
    assert len(re.findall(r"exitcode\s*:\s*2\b", result.stderr)) == 2, result.stderr[-3000:]
