"""How fast is ``torch._grouped_mm`` (CUTLASS on sm_90) at the MoE shapes of issue 20, against one dense GEMM of
the same FLOPs? The question behind it: the DeepSeek-V3 block spends ~79% of its step in these grouped GEMMs, so
its speed-up over HF is capped by them unless a grouped GEMM exists that beats CUTLASS's. The dense GEMM (cuBLAS)
of equal FLOPs is the ceiling any grouped kernel could approach; ``aligned`` routing (every expert gets exactly
``rows / E`` rows, a multiple of 128) against ``random`` routing (a multinomial draw, as a random router gives)
separates tile quantisation (ragged groups leave partly empty tiles) from the rest.

    python3 tools/bench/bench_grouped_gemm.py --out gg.json                      # GPU, both blocks
    python3 tools/bench/bench_grouped_gemm.py --out gg.json --device cpu --tiny  # CPU smoke

The six GEMMs of one experts layer, in the layout ``moe_experts=torch`` uses (``torch_impl._GroupedMM``):
``fwd_gate_up`` x[N,H] @ w[E,2I,H]^T, ``fwd_down`` a[N,I] @ w[E,H,I]^T, ``dgrad_*`` g @ w, ``wgrad_*`` g^T @ x
(the reduction dimension is the ragged one). Every grouped result is checked once against a per-expert loop over
three experts (`checked_experts`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, median_ms, rel_err, write_json  # noqa: E402

# name -> (experts E, hidden H, expert intermediate I, routed rows N = tokens * top_k)
SHAPES = {
    "deepseek_v3": (256, 7168, 2048, 8192 * 8),
    "gpt_oss": (32, 2880, 2880, 8192 * 4),
}
TINY = {"tiny": (4, 32, 16, 40)}


def group_counts(rows: int, experts: int, routing: str, generator: torch.Generator) -> torch.Tensor:
    """Rows per expert, ``[E]`` int64 summing to ``rows``: equal (``aligned``) or a uniform multinomial draw."""
    if routing == "aligned":
        if rows % experts:
            raise ValueError(f"aligned routing needs rows divisible by experts, got {rows} and {experts}")
        return torch.full((experts,), rows // experts, dtype=torch.int64)
    picks = torch.randint(experts, (rows,), generator=generator)
    return torch.bincount(picks, minlength=experts)


def group_spans(ends: torch.Tensor) -> list[tuple[int, int]]:
    """``ends [E]`` (cumulative row counts) -> each expert's ``(start, end)`` row range."""
    stops = ends.tolist()
    return list(zip([0] + stops[:-1], stops, strict=True))


def checked_experts(experts: int) -> list[int]:
    """The experts whose results are checked against a loop: first, middle, last. Not all: DeepSeek's full wgrad
    reference alone would be another 15 GB, and a per-group indexing error shows in any group."""
    return sorted({0, experts // 2, experts - 1})


def gemm_cases(
    experts: int,
    hidden: int,
    inter: int,
    rows: int,
    ends: torch.Tensor,
    checked: list[int],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[
    str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], Callable[[], torch.Tensor], float]
]:
    """name -> (grouped call, per-expert loop reference over the ``checked`` experts (concatenated rows, or stacked
    for the weight gradients), dense call of equal FLOPs, FLOPs)."""
    # Drawn on the device: DeepSeek's gate/up weights alone are 7.5e9 values, minutes of CPU randn.
    g = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5

    x, a = rand(rows, hidden), rand(rows, inter)
    g_up, g_down = rand(rows, 2 * inter), rand(rows, hidden)
    w_up, w_down = rand(experts, 2 * inter, hidden), rand(experts, hidden, inter)
    dense_up, dense_down = rand(hidden, 2 * inter), rand(inter, hidden)
    spans = group_spans(ends)

    def loop(fn: Callable[[int, int, int], torch.Tensor], stacked: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            parts = [fn(e, *spans[e]) for e in checked]
            return torch.stack(parts) if stacked else torch.cat(parts)

        return run

    def flops(m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k

    return {
        "fwd_gate_up": (
            lambda: torch._grouped_mm(x, w_up.transpose(-2, -1), offs=ends),
            loop(lambda e, s, t: x[s:t] @ w_up[e].t(), stacked=False),
            lambda: x @ dense_up,
            flops(rows, 2 * inter, hidden),
        ),
        "fwd_down": (
            lambda: torch._grouped_mm(a, w_down.transpose(-2, -1), offs=ends),
            loop(lambda e, s, t: a[s:t] @ w_down[e].t(), stacked=False),
            lambda: a @ dense_down,
            flops(rows, hidden, inter),
        ),
        "dgrad_gate_up": (
            lambda: torch._grouped_mm(g_up, w_up, offs=ends),
            loop(lambda e, s, t: g_up[s:t] @ w_up[e], stacked=False),
            lambda: g_up @ dense_up.t(),
            flops(rows, hidden, 2 * inter),
        ),
        "dgrad_down": (
            lambda: torch._grouped_mm(g_down, w_down, offs=ends),
            loop(lambda e, s, t: g_down[s:t] @ w_down[e], stacked=False),
            lambda: g_down @ dense_down.t(),
            flops(rows, inter, hidden),
        ),
        "wgrad_gate_up": (
            lambda: torch._grouped_mm(g_up.t(), x, offs=ends),
            loop(lambda e, s, t: g_up[s:t].t() @ x[s:t], stacked=True),
            lambda: g_up.t() @ x,
            flops(2 * inter, hidden, rows),
        ),
        "wgrad_down": (
            lambda: torch._grouped_mm(g_down.t(), a, offs=ends),
            loop(lambda e, s, t: g_down[s:t].t() @ a[s:t], stacked=True),
            lambda: g_down.t() @ a,
            flops(hidden, inter, rows),
        ),
    }


def run_shape(
    name: str, dims: tuple[int, int, int, int], routing: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Every GEMM of one shape and routing: ms, TFLOP/s, the dense ceiling and the check against the loop."""
    experts, hidden, inter, rows = dims
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    counts = group_counts(rows, experts, routing, torch.Generator().manual_seed(0))
    ends = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)
    spans, checked = group_spans(ends), checked_experts(experts)
    result: dict[str, Any] = {
        "experts": experts, "hidden": hidden, "inter": inter, "rows": rows, "routing": routing,
        "rows_per_expert_min_max": [int(counts.min()), int(counts.max())],
        "tiles_of_128_over_ideal": int(((counts + 127) // 128).sum()) * 128 / rows,
        "gemms": {},
    }  # fmt: skip
    total_grouped = total_dense = total_flops = 0.0
    for gemm, (grouped, reference, dense, flops) in gemm_cases(experts, hidden, inter, rows, ends, checked,
                                                               device, dtype).items():  # fmt: skip
        got = grouped()
        picked = got[checked] if got.dim() == 3 else torch.cat([got[slice(*spans[e])] for e in checked])
        err = rel_err(picked, reference())
        del got, picked
        g_ms = median_ms(grouped, device, args.warmup, args.reps)
        d_ms = median_ms(dense, device, args.warmup, args.reps)
        total_grouped, total_dense, total_flops = (
            total_grouped + g_ms,
            total_dense + d_ms,
            total_flops + flops,
        )
        result["gemms"][gemm] = {
            "grouped_ms": g_ms, "dense_ms": d_ms, "grouped_tflops": flops / g_ms / 1e9,
            "dense_tflops": flops / d_ms / 1e9, "dense_over_grouped_speed": g_ms / d_ms, "rel_err_vs_loop": err,
        }  # fmt: skip
        print(f"{name} {routing:8s} {gemm:14s} grouped {g_ms:8.3f} ms {flops / g_ms / 1e9:7.1f} TF/s | dense "
              f"{d_ms:8.3f} ms {flops / d_ms / 1e9:7.1f} TF/s | err {err:.1e}", flush=True)  # fmt: skip
    result["layer_grouped_ms"], result["layer_dense_ms"] = total_grouped, total_dense
    result["layer_grouped_tflops"] = total_flops / total_grouped / 1e9
    result["layer_dense_tflops"] = total_flops / total_dense / 1e9
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path (rewritten after every shape)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {sorted(SHAPES)}")
    p.add_argument("--routing", default="aligned,random", help="comma-separated: aligned, random")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="one tiny shape (CPU smoke test)")
    args = p.parse_args(argv)
    table = TINY if args.tiny else SHAPES
    args.shape_list = ["tiny"] if args.tiny else [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shape_list if s not in table]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; expected names from {sorted(table)}")
    args.routing_list = [r for r in args.routing.split(",") if r]
    if not set(args.routing_list) <= {"aligned", "random"}:
        p.error(f"--routing: expected aligned and/or random, got {args.routing!r}")
    args.table = table
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every shape x routing and write the JSON."""
    args = parse_args(argv)
    device = torch.device(args.device)
    out: dict[str, Any] = {"environment": environment(device), "dtype": args.dtype, "rows": {}}
    for shape in args.shape_list:
        for routing in args.routing_list:
            out["rows"][f"{shape}/{routing}"] = run_shape(shape, args.table[shape], routing, args)
            write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
