"""LM head + cross-entropy fwd+bwd (T3): veomni's fused Triton kernel vs our portable chunk_loss vs Liger vs QuACK
(when installed) vs eager, side by side, JSON out.

    python tools/bench/bench_linear_ce.py --out results.json [--sweep] [--configs] [--floor]

Default: the T3 shape (16,384 tokens, H = 2048, V = 151,936, bf16). ``--sweep`` adds tokens in {4k, 16k, 32k} x
V in {32k, 152k}; ``--configs`` times chunk sizes and row-kernel launch shapes of ours at T3; ``--floor`` times
the pieces (the three cuBLAS GEMMs per chunk, fp32 vs bf16 dW accumulation, the row kernel alone).

Each timed step is ``loss, n = fn(h, w, y); loss.backward()`` with ``.grad`` reset to None first (as
``zero_grad(set_to_none=True)`` leaves it), timed with CUDA events after warm-up; the median is reported.
"Peak extra" is the allocator's peak during one step minus what was allocated before it (inputs), so it counts
the gradients the step leaves in ``.grad``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable

import torch
import triton

from veomni.kernels.cross_entropy import chunked, eager, triton_impl

T3 = (16_384, 2048, 151_936)
SWEEP = [(t, 2048, v) for v in (32_000, 151_936) for t in (4096, 16_384, 32_768)]


def compiled_chunked_ce(chunks: int = 8) -> Callable:
    """The peer of BENCHMARKS.md's T3 row: plain torch, the tokens in ``chunks`` pieces, each piece's LM head +
    CE one ``torch.compile``d function (inductor fuses the fp32 upcast, log-softmax and gather; each piece keeps
    its logits for backward). Returns ``(loss_sum, valid_count)`` like the registry's functions."""
    import torch.nn.functional as F

    @torch.compile(fullgraph=True)
    def piece(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")

    def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        losses = [piece(hc, w, yc) for hc, yc in zip(h.chunk(chunks), y.chunk(chunks), strict=True)]
        return torch.stack(losses).sum(), (y != -100).sum()

    return fn


def _impls() -> dict[str, Callable]:
    impls = {
        "triton": triton_impl.causal_lm_cross_entropy,
        "chunk_loss": chunked.causal_lm_cross_entropy,
        "torch_compiled_8_chunks": compiled_chunked_ce(8),
        "eager": eager.causal_lm_cross_entropy,
    }
    try:  # optional (veomni-kernels[quack], sm_90+)
        from veomni.kernels import quack_backend

        impls["quack"] = quack_backend.causal_lm_cross_entropy
    except ImportError as err:
        print(f"quack unavailable: {err}", file=sys.stderr)
    try:
        from veomni.kernels.cross_entropy import liger_impl

        impls["liger"] = liger_impl.causal_lm_cross_entropy
    except ImportError as err:  # reported in the JSON, not fatal: the other columns still mean something
        print(f"liger unavailable: {err}", file=sys.stderr)
    return impls


def _inputs(n: int, hidden: int, vocab: int, seed: int = 0):  # noqa: ANN202
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (
        (torch.randn(vocab, hidden, device="cuda", generator=gen) * (2.0 / hidden**0.5))
        .bfloat16()
        .requires_grad_()
    )
    y = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    return h, w, y


def _time(step: Callable[[], None], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def bench_impl(fn: Callable, h, w, y, warmup: int = 2, reps: int = 7) -> dict:  # noqa: ANN001
    def step() -> None:
        h.grad = w.grad = None
        loss, _ = fn(h, w, y)
        loss.backward()

    try:
        step()  # compile outside the measurement
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, count = fn(h, w, y)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        result = {"loss": float(loss.detach()), "count": int(count)}
        del loss
        times = _time(step, warmup, reps)
    except torch.OutOfMemoryError as err:
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        return {"error": f"OOM: {str(err)[:160]}"}
    h.grad = w.grad = None
    return result | {"ms": statistics.median(times), "ms_all": times, "peak_extra_gib": peak / 2**30}


def run_shapes(shapes: list[tuple[int, int, int]], impls: dict[str, Callable]) -> list[dict]:
    rows = []
    for n, hidden, vocab in shapes:
        h, w, y = _inputs(n, hidden, vocab)
        row = {
            "tokens": n,
            "hidden": hidden,
            "vocab": vocab,
            "tflop": 6 * n * hidden * vocab / 1e12,
            "impls": {},
        }
        for name, fn in impls.items():
            row["impls"][name] = r = bench_impl(fn, h, w, y)
            torch.cuda.empty_cache()
            print(f"  {n:6d} {vocab:7d} {name:7s} {r.get('ms', float('nan')):9.2f} ms "
                  f"{r.get('peak_extra_gib', float('nan')):7.2f} GiB {r.get('error', '')}", flush=True)  # fmt: skip
        ours = row["impls"]["triton"]
        for r in row["impls"].values():
            if "ms" in r and "ms" in ours:
                r["ours_time_ratio"] = ours["ms"] / r["ms"]
                r["ours_mem_ratio"] = ours["peak_extra_gib"] / r["peak_extra_gib"]
                r["tflops"] = row["tflop"] / r["ms"] * 1e3
                r["loss_rel_diff_vs_ours"] = abs(r["loss"] - ours["loss"]) / abs(ours["loss"])
        rows.append(row)
        del h, w, y
        torch.cuda.empty_cache()
    return rows


def run_configs(n: int, hidden: int, vocab: int) -> list[dict]:
    h, w, y = _inputs(n, hidden, vocab)
    out = []
    base = triton_impl.default_config(n, vocab, 2)
    grid = [base._replace(chunk_tokens=c) for c in (512, 1024, 1536, 2048, 3072, 4096)]
    grid += [
        triton_impl.LaunchConfig(2048, b, nw, p)
        for b, nw, p in (
            (8192, 16, 0), (16384, 32, 0), (8192, 8, 0),
            (16384, 32, 1), (8192, 32, 1), (8192, 16, 1), (8192, 16, 2), (4096, 8, 2), (4096, 8, 4),
        )
    ]  # fmt: skip
    for cfg in grid:
        r = bench_impl(
            lambda a, b, c, cfg=cfg: triton_impl.linear_cross_entropy(a, b, c, config=cfg), h, w, y
        )
        out.append({"config": cfg._asdict()} | r)
        print(f"  config {tuple(cfg)}: {r.get('ms', float('nan')):.2f} ms "
              f"{r.get('peak_extra_gib', float('nan')):.2f} GiB {r.get('error', '')}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    return out


def run_floor(n: int, hidden: int, vocab: int, chunk: int) -> dict:
    """The pieces of one fwd+bwd at ``chunk`` rows per chunk, each timed alone over all chunks."""
    h, w, y = _inputs(n, hidden, vocab)
    h, w = h.detach(), w.detach()
    buf = torch.randn(chunk, vocab, device="cuda").bfloat16()
    dx = torch.empty(n, hidden, device="cuda", dtype=torch.bfloat16)
    acc32 = torch.zeros(vocab, hidden, device="cuda")
    acc16 = torch.zeros(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    losses = torch.empty(n, device="cuda")
    cfg = triton_impl.default_config(n, vocab, 2)
    starts = range(0, n, chunk)
    half = (vocab // 2) // 8 * 8

    def loop(body: Callable[[int], None]) -> Callable[[], None]:
        return lambda: [body(s) for s in starts]

    pieces = {
        "logits_mm": loop(lambda s: torch.mm(h[s : s + chunk], w.t(), out=buf)),
        "dx_mm": loop(lambda s: torch.mm(buf, w, out=dx[s : s + chunk])),
        "dw_addmm_fp32_two_halves": loop(
            lambda s: [
                torch.addmm(a, buf[:, lo:hi].t(), h[s : s + chunk], torch.float32, out=a)
                for lo, hi, a in ((0, half, acc32[:half]), (half, vocab, acc32[half:]))
            ]
        ),
        "dw_addmm_bf16": loop(lambda s: torch.addmm(acc16, buf.t(), h[s : s + chunk], out=acc16)),
    }
    row_cfgs = {
        "row_kernel": cfg,
        "row_kernel_1_per_sm_32w": cfg._replace(block_v=16384, num_warps=32, programs_per_sm=1),
        "row_kernel_2_per_sm_16w": cfg._replace(num_warps=16, programs_per_sm=2),
    }
    for name, rc in row_cfgs.items():
        pieces[name] = loop(
            lambda s, rc=rc: triton_impl._ce_rows_kernel[(triton_impl._programs(rc, chunk, buf.device),)](
                buf,
                y[s:],
                losses[s:],
                vocab,
                chunk,
                vocab,
                -100,
                1.0,
                0.0,
                HAS_SOFTCAP=False,
                WRITE_GRAD=True,
                BLOCK=rc.block_v,
                num_warps=rc.num_warps,
            )
        )
    gemm_tflop = 2 * n * hidden * vocab / 1e12
    out = {"chunk": chunk}
    for name, fn in pieces.items():
        if name.startswith("row_kernel"):
            buf.normal_()  # real logits, not the previous gradient
        ms = statistics.median(_time(fn, 2, 5))
        rec = {"ms": ms}
        if not name.startswith("row_kernel"):
            rec["tflops"] = gemm_tflop / ms * 1e3
        else:
            rec["gbps_3pass"] = 3 * n * vocab * 2 / ms / 1e6  # read twice, write once
        out[name] = rec
        print(f"  floor chunk={chunk} {name}: {ms:.2f} ms {rec}", flush=True)
    return out


def _table(rows: list[dict]) -> str:
    lines = [
        "| tokens | V | impl | fwd+bwd ms | TFLOP/s | peak extra GiB | ours: time ratio | ours: mem ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for name, r in row["impls"].items():
            if "ms" not in r:
                lines.append(f"| {row['tokens']} | {row['vocab']} | {name} | {r['error'][:40]} | | | | |")
                continue
            lines.append(
                f"| {row['tokens']} | {row['vocab']} | {name} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                f"{r['peak_extra_gib']:.2f} | {r['ours_time_ratio']:.3f} | {r['ours_mem_ratio']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true", help="tokens {4k,16k,32k} x V {32k,152k}, H = 2048")
    p.add_argument("--configs", action="store_true", help="chunk and launch-shape variants of ours at T3")
    p.add_argument("--floor", action="store_true", help="time the GEMMs and the row kernel alone at T3")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear_ce needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = _impls()
    rec: dict = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "liger": "liger" in impls,
        "dtype": "bfloat16",
        "default_config_t3": triton_impl.default_config(T3[0], T3[2], 2)._asdict(),
        "fused_fp32_addmm": triton_impl.mixed_addmm_supported(torch.device("cuda")),
        "timing": "CUDA events around fn + loss.backward() (grads reset to None), 2 warm-up, median of 7",
    }
    print(f"fused fp32 addmm: {rec['fused_fp32_addmm']}; default config at T3: {rec['default_config_t3']}")
    if a.floor:
        rec["floor"] = [run_floor(*T3, chunk) for chunk in (1024, 2048)]
    if a.configs:
        rec["configs"] = run_configs(*T3)
    rec["results"] = run_shapes(SWEEP if a.sweep else [T3], impls)
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(_table(rec["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
