"""Signals stop a run cleanly: the first saves a complete checkpoint at the next step boundary (every rank agrees
on it), the same signal again stops at once without a checkpoint marked complete. Real subprocesses, real
signals, a real two-rank gloo group."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from veomni.train.checkpoint import latest_complete
from veomni.train.stop_signals import StopRequests

LONG_RUN = [
    "quickstart", "--train.steps=100000", "--train.epochs=null", "--train.log_interval=1",
    "--train.eval_interval=null", "--data.eval_files=[]", "--checkpoint.hf_export=false",
]  # fmt: skip


def test_the_first_signal_only_asks_and_the_same_one_again_interrupts():
    with StopRequests(group=None) as stop:
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == "SIGTERM"
        os.kill(os.getpid(), signal.SIGUSR1)  # another kind of signal does not escalate
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handlers are back


def _start(run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "veomni.train.cli", *LONG_RUN, f"--checkpoint.dir={run_dir}", *extra]
    # SIGINT back to its default: a test run started in the background of a shell inherits it ignored, and
    # Python then never raises KeyboardInterrupt.
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def _wait_for_trained_steps(run_dir: Path, procs: list[subprocess.Popen], steps: int) -> None:
    """Until metrics.jsonl holds `steps` trained steps (no time limit: a dead process ends the wait instead)."""
    metrics = run_dir / "metrics.jsonl"
    while True:
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"a run ended before it was signalled: {dead[0].communicate()[1][-3000:]}"
        if metrics.is_file():
            trained = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
            if len(trained) >= steps:
                return
        time.sleep(0.2)


def test_sigterm_saves_a_complete_checkpoint_exits_143_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--log.file=auto")
    _wait_for_trained_steps(run_dir, [proc], 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    # Piped output, as in a redirected log: no bar redraws (no carriage return anywhere), one plain line per
    # log_interval with the wall-clock time, the elapsed time and the ETA, and the signal's lines each on its own.
    assert "\r" not in out and "\r" not in err
    steps = [line for line in out.splitlines() if " step " in line and "| loss " in line]
    assert len(steps) >= 2
    assert all(
        re.match(r"\[\d\d:\d\d:\d\d\] step \d+/100000 \| loss .* \| elapsed \S+ \| eta \S+$", line)
        for line in steps
    )
    assert all(line.startswith("veomni-train: ") for line in err.splitlines() if "veomni-train: " in line)
    assert "veomni-train: SIGTERM: saving a checkpoint at the next step boundary; SIGTERM again stops" in err
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith("veomni-train: stopped on SIGTERM after step ") and "checkpoint.resume=auto" in last
    )
    saved = latest_complete(run_dir)
    step = int(saved.name.removeprefix("step_"))
    assert f"after step {step}: saved {saved}" in last and step >= 2
    # Every trained step reached metrics.jsonl before the exit.
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == step

    # log.file=auto: train.log beside the checkpoints holds the same lines, stamped, and ends with the last one.
    log_lines = (run_dir / "train.log").read_text().splitlines()
    assert "\r" not in "".join(log_lines)
    assert any("INFO veomni.train.console: step 2/100000 | loss " in line for line in log_lines)
    assert log_lines[-1].endswith(f"WARNING veomni.train.console: {last}")

    resumed = subprocess.run(
        [sys.executable, "-m", "veomni.train.cli", *LONG_RUN, f"--checkpoint.dir={run_dir}",
         "--checkpoint.resume=auto", f"--train.steps={step + 2}", "--log.file=auto"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "done: 2 steps" in resumed.stdout
    log_lines = (run_dir / "train.log").read_text().splitlines()  # appended to
    assert any(line.endswith(f"console: {last}") for line in log_lines)
    assert log_lines[-1].endswith(
        "INFO veomni.train.console: done: 2 steps, loss " + resumed.stdout.split(", loss ")[-1].strip()
    )


def test_ctrl_c_with_save_on_signal_off_stops_at_once_in_one_line(tmp_path):
    """The "stop now" path (what a second Ctrl-C raises): one line, exit 130, no checkpoint marked complete."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--checkpoint.save_on_signal=false")
    _wait_for_trained_steps(run_dir, [proc], 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("veomni-train: interrupted: stopped at once")
    assert latest_complete(run_dir) is None


def test_a_second_ctrl_c_stops_at_once_without_a_complete_checkpoint(tmp_path):
    """The user's double Ctrl-C: the first asks for a save at the next step boundary, the second (sent as soon as
    the first is acknowledged, so before that save can finish) stops the process there and then."""
    run_dir = tmp_path / "run"
    with (tmp_path / "stdout.txt").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "veomni.train.cli", *LONG_RUN, f"--checkpoint.dir={run_dir}"],
            stdout=out, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        _wait_for_trained_steps(run_dir, [proc], 1)
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        seen = []
        while not (line := proc.stderr.readline()).startswith("veomni-train: SIGINT: saving a checkpoint"):
            assert line, "".join(seen)[-3000:]  # the process ended without acknowledging the first Ctrl-C
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait()
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest
    assert rest.strip().splitlines()[-1] == (
        "veomni-train: interrupted: stopped at once, nothing saved for the current step"
    )
    # Whatever the save had begun to write carries no COMPLETE marker, so checkpoint.resume=auto never takes it.
    assert latest_complete(run_dir) is None
    assert not list(run_dir.glob("step_*/COMPLETE"))


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the signal mask from /proc")
def test_sigterm_while_the_model_is_built_stops_before_the_first_step(tmp_path):
    # A scheduler's SIGTERM during a long load. Python itself never catches SIGTERM: once the process does, the
    # trainer's handler is in place (from the start of train()), and the build takes seconds more.
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "veomni-train: stopped on SIGTERM after step 0: nothing saved (checkpoint.dir holds no state); run the "
        "same command with checkpoint.resume=auto to continue"
    )
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()  # no step was trained
    assert latest_complete(run_dir) is None


def _loading_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun to import torch (its native library is mapped)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's mappings from /proc")
def test_ctrl_c_while_torch_is_still_importing_is_one_line(tmp_path):
    # Sent while torch is being imported (seconds; the CLI's own module imports only the standard library), long
    # before any model is built: Python code runs there, so the SIGINT becomes a KeyboardInterrupt.
    proc = _start(tmp_path / "run")
    while not _loading_torch(proc.pid):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["veomni-train: interrupted: stopped at once"], err[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [
        _start(run_dir, env={**common, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"})
        for r in range(2)
    ]
    _wait_for_trained_steps(run_dir, procs, 2)
    procs[1].send_signal(signal.SIGUSR1)
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [138, 138], [e[-2000:] for e in errs]
    assert not any("Traceback" in e for e in errs)
    assert errs[0].strip().splitlines()[-1].startswith("veomni-train: stopped on SIGUSR1 after step ")
    saved = latest_complete(run_dir)
    assert saved is not None and (saved / "rank_00000.pt").is_file() and (saved / "rank_00001.pt").is_file()
