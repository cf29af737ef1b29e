"""The console on a terminal: the progress bar is drawn, and the log records and metric lines written while it is
drawn each start a line of their own (a real pseudo-terminal, a real quickstart run). The redirected case, with no
bar at all, is checked in test_signals (piped) and test_first_contact (log.file)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

SHORT = [
    "--train.steps=3", "--train.epochs=null", "--optim.warmup_steps=1", "--train.eval_interval=null",
    "--data.eval_files=[]", "--checkpoint.hf_export=false", "--checkpoint.interval=1", "--train.log_interval=1",
]  # fmt: skip


def test_on_a_terminal_log_lines_are_written_above_the_bar_not_after_it(tmp_path):
    leader, follower = pty.openpty()
    # A window size (a fresh pseudo-terminal has 0x0, and a bar of width 0 draws nothing).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "veomni.train.cli", "quickstart", *SHORT, f"--checkpoint.dir={tmp_path / 'run'}"],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait() == 0, b"".join(chunks)[-3000:].decode(errors="replace")
    text = (
        b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    )  # the terminal's own newline mapping
    assert "train:" in text and "\r" in text  # a terminal: the bar was drawn and redrawn
    # Each record and metric line begins its line, or follows the bar's clearing carriage return: what follows the
    # last "\r" of a line is never the bar with a record glued on.
    starts = [line.split("\r")[-1] for line in text.split("\n") if "INFO veomni" in line or "| loss " in line]
    assert any(
        "INFO veomni.train.checkpoint: checkpoint" in s for s in starts
    )  # logged while the bar was drawn
    assert sum("| loss " in s for s in starts) == 3
    glued = [s for s in starts if not s.startswith("[")]
    assert not glued, glued
    assert "done: 3 steps" in text
