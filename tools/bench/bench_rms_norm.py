"""RMSNorm fwd+bwd, bf16: eager, ``F.rms_norm``, Liger and veomni's Triton kernel side by side; JSON out.

Usage (one GPU): ``python tools/bench/bench_rms_norm.py --out rms.json [--sweep]``

Bytes per fwd+bwd (the T4 formula, notebook/benchmarks-log.md): read x, w, dy and write y, dx, i.e.
``(4·N·H + H) · 2`` for bf16. The least any training fwd+bwd can actually move is one more pass (backward
must read x, or some other saved [N, H] tensor, a second time): ``(5·N·H + 2·H) · 2`` counting w read and dW
written too; both are reported. Bandwidths are compared with a measured device-to-device copy
(``torch.empty_like(b).copy_(b)`` of a 2 GiB buffer, bytes read + written). Times are
``triton.testing.do_bench`` medians (CUDA events, L2 flushed between repetitions); each step is launched
from Python, so where the GPU work is shorter than the host's launch work (small shapes) the host sets the
time. ``ms_graph`` times the same step captured 10 times in one CUDA graph (median of 20 replays, no L2
flush): the GPU's time alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

from veomni.kernels.rms_norm import eager, triton_impl
from veomni.kernels.rms_norm.triton_impl import LaunchConfig

EPS = 1e-6


def _liger() -> tuple[object | None, str]:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as exc:  # optional peer
        return None, f"liger-kernel not importable: {exc}"
    import importlib.metadata as md

    def fn(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # Llama casting, no offset; in_place=False so dy survives for the other implementations.
        return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)

    return fn, md.version("liger-kernel")


def _quack() -> object | None:
    # Optional contender (veomni-kernels[quack], sm_90+): our registered quack backend, so its wrapper is timed too.
    try:
        from veomni.kernels import quack_backend
    except ImportError as exc:
        print(f"quack unavailable: {exc}", file=sys.stderr)
        return None
    return quack_backend.rms_norm_standard


def _impls() -> tuple[dict[str, object], str]:
    liger, liger_note = _liger()
    impls = {
        "eager": eager.rms_norm_standard,
        # The peer as PyTorch ships it: one fused kernel, weight applied in fp32 (not Llama's cast order).
        "torch_F.rms_norm": lambda x, w, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps),
        "liger": liger,
        "veomni_triton": triton_impl.rms_norm_standard,
        "quack": _quack(),
    }
    return {k: v for k, v in impls.items() if v is not None}, liger_note


def copy_bandwidth(nbytes: int = 2 << 30) -> dict[str, float]:
    """Device-to-device copy rate in GB/s counting bytes read + written (the practical HBM ceiling)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return {"bytes_moved": 2 * nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6}


def _step(fn, x, w, dy):  # noqa: ANN001, ANN202
    def step() -> None:
        fn(x, w, EPS).backward(dy)

    return step


def _graph_ms(step, inner: int = 10, reps: int = 20) -> float:  # noqa: ANN001
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocator) off the capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _try_graph(step) -> tuple[float | None, str | None]:  # noqa: ANN001
    try:
        return _graph_ms(step), None
    except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured is reported, not fatal
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}"[:200]


def _grad_step(fn, x, w, dy):  # noqa: ANN001, ANN202
    # autograd.grad rather than backward: grads are fresh each call, never accumulated inside the graph.
    def step() -> None:
        torch.autograd.grad(fn(x, w, EPS), [x, w], dy)

    return step


def _fwd(fn, x, w):  # noqa: ANN001, ANN202
    def fwd() -> None:
        with torch.no_grad():
            fn(x, w, EPS)

    return fwd


def _peak_mb(fn, x, w, dy) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    x.grad = w.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(x, w, EPS).backward(dy)
    torch.cuda.synchronize()
    x.grad = w.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _inputs(rows: int, hidden: int):  # noqa: ANN202
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    return x, w, dy


def _sweep_configs(hidden: int) -> list[LaunchConfig]:
    d = triton_impl.default_config(hidden)
    out = [d, d._replace(fwd_warps=max(1, d.fwd_warps // 2))]
    out += [d._replace(bwd_acc2d=True, bwd_block_r=r) for r in (2, 4)]
    out += [d._replace(bwd_acc2d=True, bwd_block_r=2, bwd_warps=min(32, 2 * d.bwd_warps))]
    out += [d._replace(bwd_acc2d=True, bwd_block_r=2, progs_per_sm=1)]
    return list(dict.fromkeys(out))


def run(shapes: list[tuple[int, int]], sweep: bool) -> dict:
    """Time every implementation at every (rows, hidden); returns the JSON-ready record."""
    impls, liger_note = _impls()
    copy = copy_bandwidth()
    results, sweeps = [], []
    for rows, hidden in shapes:
        x, w, dy = _inputs(rows, hidden)
        t4_bytes = (4 * rows * hidden + hidden) * 2
        min_bytes = (5 * rows * hidden + 2 * hidden) * 2
        row = {"rows": rows, "hidden": hidden, "t4_bytes": t4_bytes, "min_bytes": min_bytes, "impls": {}}
        for name, fn in impls.items():
            ms = do_bench(_step(fn, x, w, dy), grad_to_none=[x, w], return_mode="median")
            ms_fwd = do_bench(_fwd(fn, x, w), return_mode="median")
            gbps = t4_bytes / ms / 1e6
            ms_graph, graph_err = _try_graph(_grad_step(fn, x, w, dy))
            row["impls"][name] = {
                "ms": ms,
                "ms_fwd": ms_fwd,
                "gbps": gbps,
                "pct_copy": 100 * gbps / copy["gbps"],
                "gbps_min_traffic": min_bytes / ms / 1e6,
                "pct_copy_min_traffic": 100 * min_bytes / ms / 1e6 / copy["gbps"],
                "peak_mb": _peak_mb(fn, x, w, dy),
                "ms_graph": ms_graph,
                "graph_error": graph_err,
                "pct_copy_graph": None
                if ms_graph is None
                else 100 * t4_bytes / ms_graph / 1e6 / copy["gbps"],
            }
        ours = row["impls"]["veomni_triton"]["ms"]
        row["speedup_vs"] = {k: v["ms"] / ours for k, v in row["impls"].items() if k != "veomni_triton"}
        ours_g = row["impls"]["veomni_triton"]["ms_graph"]
        row["speedup_vs_graph"] = {
            k: v["ms_graph"] / ours_g
            for k, v in row["impls"].items()
            if k != "veomni_triton" and v["ms_graph"] and ours_g
        }
        results.append(row)
        print(
            f"rows={rows} H={hidden}: "
            + ", ".join(f"{k} {v['ms']:.3f} ms ({v['pct_copy']:.0f}%)" for k, v in row["impls"].items()),
            flush=True,
        )
        if sweep:
            for cfg in _sweep_configs(hidden):
                fn = lambda a, b, e, cfg=cfg: triton_impl._apply(a, b, None, e, 0, cfg)  # noqa: E731
                ms = do_bench(
                    _step(fn, x, w, dy), grad_to_none=[x, w], warmup=10, rep=50, return_mode="median"
                )
                ms_fwd = do_bench(_fwd(fn, x, w), warmup=10, rep=50, return_mode="median")
                ms_graph, _ = _try_graph(_grad_step(fn, x, w, dy))
                sweeps.append(
                    {
                        "rows": rows,
                        "hidden": hidden,
                        "config": cfg._asdict(),
                        "ms": ms,
                        "ms_fwd": ms_fwd,
                        "ms_graph": ms_graph,
                        "pct_copy": 100 * t4_bytes / ms / 1e6 / copy["gbps"],
                    }
                )
                print(
                    f"  sweep {tuple(cfg)}: {ms:.3f} ms (fwd {ms_fwd:.3f}, graph {_fmt(ms_graph, 3)})",
                    flush=True,
                )
        x = w = dy = None  # free before the next shape's buffers
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "liger": liger_note,
        "dtype": "bfloat16",
        "eps": EPS,
        "bytes_formula": "t4_bytes = (4*N*H + H)*2 (x, w, dy read; y, dx written); "
        "min_bytes = (5*N*H + 2*H)*2 (x read twice, dW written)",
        "timing": "triton.testing.do_bench median, fwd+bwd = fn(x, w).backward(dy), grads reset each rep; "
        "ms_graph: autograd.grad(fn(x, w), [x, w], dy) x10 in one CUDA graph, median of 20 replays / 10",
        "copy": copy,
        "results": results,
        "sweep": sweeps,
    }


def _fmt(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _table(rec: dict) -> str:
    copy = rec["copy"]["gbps"]
    lines = [
        f"copy: {copy:.0f} GB/s on {rec['device']}; liger: {rec['liger']}",
        "| rows | H | impl | fwd+bwd ms | fwd ms | GB/s (T4) | % copy (T4) | % copy (5-pass) | graph ms |"
        " % copy (T4, graph) | peak MiB | ours vs it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rec["results"]:
        for name, v in r["impls"].items():
            sp = r["speedup_vs"].get(name)
            lines.append(
                f"| {r['rows']} | {r['hidden']} | {name} | {v['ms']:.3f} | {v['ms_fwd']:.3f} | "
                f"{v['gbps']:.0f} | {v['pct_copy']:.1f} | {v['pct_copy_min_traffic']:.1f} | "
                f"{_fmt(v['ms_graph'], 3)} | {_fmt(v['pct_copy_graph'], 1)} | "
                f"{v['peak_mb']:.0f} | {f'{sp:.2f}x' if sp else '-'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, write JSON, print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the JSON record")
    p.add_argument("--rows", default="16384,65536")
    p.add_argument("--hidden", default="2048,4096,8192")
    p.add_argument("--sweep", action="store_true", help="also time launch-config variants of ours")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rms_norm needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [(int(r), int(h)) for r in a.rows.split(",") for h in a.hidden.split(",")]
    rec = run(shapes, a.sweep)
    rec["command"] = " ".join(["python", *sys.argv])
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(_table(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
