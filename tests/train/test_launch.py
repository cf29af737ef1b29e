"""The launches docs/launch.md describes, on this box: two torchrun agents meeting through c10d rendezvous (two
"nodes" on localhost, gloo), and an elastic restart after a worker is killed mid-run, which continues from the
newest complete checkpoint with the same loss curve as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# A short text run on the quickstart's data and tokenizer; every step logged, a checkpoint every 3 steps.
RUN = [
    "quickstart", "--train.epochs=null", "--train.log_interval=1", "--train.eval_interval=null",
    "--data.eval_files=[]", "--optim.warmup_steps=1", "--checkpoint.hf_export=false",
]  # fmt: skip


# torchrun sets OMP_NUM_THREADS=1 only when it starts more than one process per node: the two one-process "nodes"
# would run multi-threaded CPU kernels (another summation order, last-bit gradient differences) against the
# two-process agent's single-threaded ones. Bitwise-equal curves need the same threading on both sides.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "veomni.train.cli", *RUN]


def curve(metrics: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) as the run's final history: lines after a resume marker supersede the steps
    above it (docs/train.md, Checkpoints)."""
    history: dict[int, tuple[float, float]] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "resumed_from" in record:
            history = {s: v for s, v in history.items() if s <= record["step"]}
        elif "loss" in record:
            history[record["step"]] = (record["loss"], record["grad_norm"])
    return history


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while being read
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_two_node_rendezvous_and_an_elastic_restart_give_the_same_curve(tmp_path):
    steps = ["--train.steps=8", "--checkpoint.interval=3", "--checkpoint.resume=auto"]
    # Two agents of one process each ("nodes") meeting through c10d rendezvous: world size 2.
    port, two_nodes = _free_port(), tmp_path / "two_nodes"
    rendezvous = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
    ]  # fmt: skip
    agents = [
        subprocess.Popen(
            [*_torchrun(*rendezvous), *steps, f"--checkpoint.dir={two_nodes}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ONE_THREAD,
        )  # fmt: skip
        for _ in range(2)
    ]
    results = [(a.communicate(), a.returncode) for a in agents]
    assert [code for _, code in results] == [0, 0], [err[-2000:] for (_, err), _ in results]
    assert sum("done: 8 steps" in out_text for (out_text, _), _ in results) == 1  # rank 0's agent
    assert (two_nodes / "step_00000008" / "rank_00001.pt").is_file()  # the other "node" wrote its rank's state

    # One agent of two workers that may restart once; one worker is killed once step 4 is logged (past the
    # step-3 checkpoint). torchrun restarts both, resume=auto continues from step 3.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: restarted workers sharing the rendezvous store read the dead attempt's
    # gloo/NCCL addresses and hang or fail in init_process_group (pytorch/pytorch#135712; docs/launch.md).
    elastic = tmp_path / "elastic"
    agent = subprocess.Popen(
        [*_torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1"), *steps,
         f"--checkpoint.dir={elastic}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**ONE_THREAD, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )  # fmt: skip
    while not ((elastic / "metrics.jsonl").is_file() and 4 in curve(elastic / "metrics.jsonl")):
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        time.sleep(0.1)
    workers = _children(agent.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    _, err = agent.communicate()
    assert agent.returncode == 0, err[-3000:]
    lines = (elastic / "metrics.jsonl").read_text().splitlines()
    markers = [json.loads(line) for line in lines if "resumed_from" in line]
    assert markers and markers[-1]["resumed_from"].endswith("step_00000003"), markers
    # The same world size and data order: the restarted run's curve is the uninterrupted one, bit for bit.
    assert curve(elastic / "metrics.jsonl") == curve(two_nodes / "metrics.jsonl")
    assert sorted(curve(elastic / "metrics.jsonl")) == list(range(1, 9))
