"""MoE experts fwd+bwd: veomni (triton, torch) vs HF Qwen3MoeExperts (grouped_mm, eager), side by side, JSON out.

    python tools/bench/bench_moe.py --out results.json [--tune] [--sweep] [--smoke]

Shapes are Qwen3-30B-A3B's experts (E=128, top-8, H=2048, I=768) at 16,384 tokens (target T2), bf16; --sweep adds
E in {8, 64, 128, 256} x tokens in {4k, 16k, 32k} (HF's eager loop only at the T2 shape: it takes seconds).
Every implementation gets the same weights, router output and upstream gradient; a step is ``out = f(hidden,
ids, weights, W1, W2)`` then ``torch.autograd.grad`` for hidden, the routing weights and both expert weights
(no ``.grad`` accumulation). Times are medians of CUDA-event-timed steps after warm-up.

FLOPs counted (expert GEMMs only): forward = 3 GEMMs of ``2*N*H*I`` each (gate and up are one ``[N,H]x[H,2I]``
GEMM) = ``6*N*H*I`` with ``N = tokens*top_k``; backward = dgrad + wgrad of each = ``12*N*H*I``; so
fwd+bwd = ``18*tokens*top_k*H*I`` (3.71 TFLOP at the T2 shape). Routing, permutation and combine are not counted.

--tune times every candidate tile config of each Triton kernel at the T2 shape (compiling them in parallel
worker processes first), uses the fastest per kernel for the rest of the run, and reports them (the table in
veomni/kernels/moe_experts/configs.py is copied from such a run). --smoke runs tiny shapes on any device
(CPU: Triton's interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

T2 = {"tokens": 16384, "experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
SMOKE = {"tokens": 12, "experts": 4, "top_k": 2, "hidden": 32, "inter": 16}
CANDIDATES: dict[str, list[tuple[int, int, int, int, int]]] = {
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); gate_up holds two BLOCK_N-wide accumulators.
    "gate_up": [
        (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3),
        (64, 128, 64, 4, 4), (128, 64, 128, 8, 3), (256, 64, 64, 8, 3), (64, 64, 64, 4, 5),
        (128, 128, 64, 8, 4),
    ],
    "rows": [
        (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
        (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 2),
        (128, 256, 64, 8, 4),
    ],
    "wgrad": [
        (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 128, 128, 8, 2),
        (128, 256, 64, 8, 4),
    ],
}  # fmt: skip
# down_dgrad: the fused-epilogue kernel (6th field False) and the split GEMM + elementwise pass (True).
CANDIDATES["down_dgrad"] = (
    [(*c, False) for c in CANDIDATES["rows"]]
    + [(*c, False) for c in [(128, 64, 64, 8, 4), (128, 64, 64, 8, 3), (64, 64, 64, 4, 4)]]
    + [(*c, True) for c in CANDIDATES["rows"]]
)
CANDIDATES["wgrad"] += [
    (128, 128, 64, 4, 4),
    (128, 128, 32, 8, 4),
    (128, 256, 32, 8, 4),
    (128, 128, 32, 4, 5),
]
GROUP = {"gate_up": "gate_up", "down": "rows", "down_dgrad": "down_dgrad", "up_dgrad": "rows",
         "wgrad_down": "wgrad", "wgrad_gate_up": "wgrad"}  # fmt: skip


def flops(shape: dict) -> float:
    return 18.0 * shape["tokens"] * shape["top_k"] * shape["hidden"] * shape["inter"]


def make_inputs(shape: dict, device: str, seed: int = 0) -> dict:
    """bf16 hidden/weights, a softmax top-k router (normalised, cast to bf16 as Qwen3-MoE does), grad_out."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t, e, k, h, i = (shape[n] for n in ("tokens", "experts", "top_k", "hidden", "inter"))
    dt = torch.bfloat16
    probs = torch.softmax(torch.randn(t, e, device=device, generator=gen), -1)
    top, ids = probs.topk(k, -1)
    return {
        "hidden": torch.randn(t, h, device=device, generator=gen).to(dt).requires_grad_(),
        "ids": ids,
        "weights": (top / top.sum(-1, keepdim=True)).to(dt).requires_grad_(),
        "w1": (torch.randn(e, 2 * i, h, device=device, generator=gen) * h**-0.5).to(dt).requires_grad_(),
        "w2": (torch.randn(e, h, i, device=device, generator=gen) * i**-0.5).to(dt).requires_grad_(),
        "grad": torch.randn(t, h, device=device, generator=gen).to(dt),
    }


def hf_experts(shape: dict, impl: str, inp: dict):
    """An HF Qwen3MoeExperts sharing ``inp``'s weights, dispatching to experts implementation ``impl``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(
        hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"], num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], hidden_act="silu",
    )  # fmt: skip
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(inp["w1"].detach(), requires_grad=True)
    mod.down_proj = torch.nn.Parameter(inp["w2"].detach(), requires_grad=True)
    return mod, lambda hidden, ids, weights, w1, w2: mod(hidden, ids, weights)


def implementations(shape: dict, inp: dict, with_eager: bool) -> dict:
    from veomni.kernels.moe_experts.torch_impl import moe_experts_routed_torch
    from veomni.kernels.moe_experts.triton_impl import moe_experts_routed_triton

    impls = {
        "veomni_triton": (moe_experts_routed_triton, None),
        "veomni_torch": (moe_experts_routed_torch, None),
    }
    try:  # optional (veomni-kernels[quack], sm_90+): quack's varlen GEMM in our routing
        from veomni.kernels.quack_backend import moe_experts_routed as moe_experts_routed_quack

        impls["veomni_quack"] = (moe_experts_routed_quack, None)
    except ImportError as err:
        impls["veomni_quack"] = (None, f"ImportError: {err}"[:300])
    names = ["grouped_mm"] + (["eager"] if with_eager else [])
    for name in names:
        try:
            mod, fn = hf_experts(shape, name, inp)
            impls[f"hf_{name}"] = (fn, mod)
        except Exception as err:  # noqa: BLE001 - a missing peer is a result, not a crash
            impls[f"hf_{name}"] = (None, f"{type(err).__name__}: {err}"[:300])
    return impls


def _timer(device: str):
    if device == "cuda":

        def run(step, warmup: int, reps: int) -> float:
            for _ in range(warmup):
                step()
            torch.cuda.synchronize()
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(reps)
            ]
            for start, end in events:
                start.record()
                step()
                end.record()
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) for s, e in events)
    else:

        def run(step, warmup: int, reps: int) -> float:
            for _ in range(warmup):
                step()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

    return run


def bench_impl(name: str, fn, mod, shape: dict, inp: dict, device: str, reps: int) -> dict:
    row = {"impl": name, **shape}
    if fn is None:
        return row | {"error": mod}
    leaves = [inp["hidden"], inp["weights"]] + (
        [mod.gate_up_proj, mod.down_proj] if mod is not None else [inp["w1"], inp["w2"]]
    )
    w1, w2 = leaves[2], leaves[3]

    def fwd():
        return fn(inp["hidden"], inp["ids"], inp["weights"], w1, w2)

    def step():
        torch.autograd.grad(fwd(), leaves, inp["grad"])

    timer = _timer(device)
    try:
        slow = name == "hf_eager"
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        step()  # compile, first-call allocations
        if device == "cuda":
            torch.cuda.synchronize()
            row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = timer(step, 1 if slow else 3, 3 if slow else reps)
        with torch.no_grad():
            fwd_ms = timer(fwd, 1, 3 if slow else reps)
    except Exception as err:  # noqa: BLE001
        return row | {"error": f"{type(err).__name__}: {err}"[:300]}
    return row | {"ms": ms, "fwd_ms": fwd_ms, "tflops": flops(shape) / ms / 1e9}


def bench_shape(shape: dict, device: str, with_eager: bool, reps: int) -> list[dict]:
    inp = make_inputs(shape, device)
    rows = [
        bench_impl(n, fn, mod, shape, inp, device, reps)
        for n, (fn, mod) in implementations(shape, inp, with_eager).items()
    ]
    by = {r["impl"]: r["ms"] for r in rows if "ms" in r}
    for r in rows:
        if "ms" in r:
            for peer in ("hf_grouped_mm", "hf_eager", "veomni_torch"):
                if peer in by and peer != r["impl"]:
                    r[f"speedup_vs_{peer}"] = by[peer] / r["ms"]
    del inp
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- tuning ----


def _kernel_call(kind: str, cfg: dict, shape: dict, device: str):
    """A closure launching one Triton kernel of the fwd+bwd at ``shape`` with tile config ``cfg``."""
    from veomni.kernels.moe_experts import triton_kernels as kern
    from veomni.kernels.moe_experts.common import expert_major_order

    inp = make_inputs(shape, device)
    e, k = shape["experts"], shape["top_k"]
    n, i = shape["tokens"] * k, shape["inter"]
    order, offsets = expert_major_order(inp["ids"], e)
    x, rw, w1, w2, dout = (inp[n_].detach() for n_ in ("hidden", "weights", "w1", "w2", "grad"))
    rnd = lambda *s: torch.randn(*s, device=device).to(torch.bfloat16)  # noqa: E731
    if kind == "gate_up":
        return lambda: kern.gate_up(x, order, k, offsets, w1, rw, cfg)
    if kind == "down":
        hw = rnd(n, i)
        return lambda: kern.rows_gemm(hw, offsets, w2, True, order, cfg)
    if kind == "down_dgrad":
        gu = rnd(n, 2 * i)
        return lambda: kern.down_dgrad(dout, order, k, offsets, w2, gu, rw, True, cfg)
    if kind == "up_dgrad":
        dgu = rnd(n, 2 * i)
        return lambda: kern.rows_gemm(dgu, offsets, w1, False, order, cfg)
    if kind == "wgrad_down":
        hw = rnd(n, i)
        return lambda: kern.wgrad(dout, order, hw, None, k, offsets, e, cfg)
    if kind == "wgrad_gate_up":
        dgu = rnd(n, 2 * i)
        return lambda: kern.wgrad(dgu, None, x, order, k, offsets, e, cfg)
    raise KeyError(kind)


def _cfg_dict(c: tuple) -> dict:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT")
    return dict(zip(keys, c if len(c) == 6 else (*c, False), strict=True))


def _split_agrees(shape: dict, fused: tuple, split: tuple, device: str) -> dict:
    """The two down-dgrad paths on the same inputs: relative Frobenius differences of d[gate, up] and dw."""
    from veomni.kernels.moe_experts import triton_kernels as kern
    from veomni.kernels.moe_experts.common import expert_major_order

    inp = make_inputs(shape, device, seed=5)
    k, i = shape["top_k"], shape["inter"]
    order, offsets = expert_major_order(inp["ids"], shape["experts"])
    gu = torch.randn(order.shape[0], 2 * i, device=device).to(torch.bfloat16)
    args = (inp["grad"], order, k, offsets, inp["w2"].detach(), gu, inp["weights"].detach(), True)
    a, b = kern.down_dgrad(*args, _cfg_dict(fused)), kern.down_dgrad(*args, _cfg_dict(split))
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731
    return {"fused": fused, "split": split, "rel_dgu": rel(a[0], b[0]), "rel_dw": rel(a[1], b[1])}


def _compile_one(kind: str, cand: tuple, shape: dict) -> str | None:
    """Worker: compile (and run once) one kernel config, filling Triton's on-disk cache. None or an error."""
    try:
        _kernel_call(kind, _cfg_dict(cand), shape, "cuda")()
        torch.cuda.synchronize()
        return None
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"[:200]


def _warm_shape(shape: dict, configs: dict) -> str | None:
    """Worker: one triton fwd+bwd at ``shape`` with ``configs``, so later timings hit the compile cache."""
    try:
        from veomni.kernels.moe_experts import configs as table
        from veomni.kernels.moe_experts.triton_impl import moe_experts_routed_triton

        table.SM90_HALF.update(configs)
        inp = make_inputs(shape, "cuda")
        out = moe_experts_routed_triton(inp["hidden"], inp["ids"], inp["weights"], inp["w1"], inp["w2"])
        torch.autograd.grad(out, [inp["hidden"], inp["weights"], inp["w1"], inp["w2"]], inp["grad"])
        torch.cuda.synchronize()
        return None
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"[:200]


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))


def tune(shape: dict, device: str, workers: int, reps: int) -> dict:
    jobs = [(kind, c) for kind, group in GROUP.items() for c in CANDIDATES[group]]
    compile_errors: dict = {}
    t0 = time.time()
    if device == "cuda":
        with _pool(workers) as pool:
            futures = {pool.submit(_compile_one, kind, c, shape): (kind, c) for kind, c in jobs}
            for fut in cf.as_completed(futures):
                err = fut.result()
                if err:
                    compile_errors[str(futures[fut])] = err
    compile_s = time.time() - t0
    timer, results, best = _timer(device), [], {}
    for kind, c in jobs:
        row = {"kind": kind, "config": c}
        if str((kind, c)) in compile_errors:
            results.append(row | {"error": compile_errors[str((kind, c))]})
            continue
        try:
            call = _kernel_call(kind, _cfg_dict(c), shape, device)
            row["ms"] = timer(call, 2, reps)
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        results.append(row)
        if "ms" in row and (kind not in best or row["ms"] < best[kind]["ms"]):
            best[kind] = row
        if device == "cuda":
            torch.cuda.empty_cache()
    print(
        f"tune: {len(jobs)} configs compiled in {compile_s:.0f} s, timed in {time.time() - t0 - compile_s:.0f} s"
    )
    by_split = {}
    for row in results:
        if row["kind"] == "down_dgrad" and "ms" in row:
            flag = row["config"][5]
            if flag not in by_split or row["ms"] < by_split[flag]["ms"]:
                by_split[flag] = row
    agree = None
    if len(by_split) == 2:
        agree = _split_agrees(shape, by_split[False]["config"], by_split[True]["config"], device)
        print(f"  down_dgrad fused vs split: {agree}")
    for kind, row in best.items():
        print(f"  best {kind:14s} {row['config']}  {row['ms']:.3f} ms")
    return {
        "shape": shape,
        "results": results,
        "best": {k: r["config"] for k, r in best.items()},
        "compile_s": compile_s,
        "down_dgrad_fused_vs_split": agree,
    }


def profile_triton(shape: dict) -> list[dict]:
    """GPU time per kernel of one veomni triton fwd+bwd step (torch.profiler, mean of 3 steps)."""
    from torch.profiler import ProfilerActivity, profile

    from veomni.kernels.moe_experts.triton_impl import moe_experts_routed_triton

    inp = make_inputs(shape, "cuda")
    leaves = [inp["hidden"], inp["weights"], inp["w1"], inp["w2"]]

    def step():
        out = moe_experts_routed_triton(inp["hidden"], inp["ids"], inp["weights"], inp["w1"], inp["w2"])
        torch.autograd.grad(out, leaves, inp["grad"])

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        device_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if device_us:
            rows.append(
                {"name": ev.key[:80], "ms_per_step": device_us / 3 / 1e3, "calls_per_step": ev.count / 3}
            )
    rows.sort(key=lambda r: -r["ms_per_step"])
    print("profile (veomni triton, one fwd+bwd step):")
    for r in rows[:14]:
        print(f"  {r['ms_per_step']:7.3f} ms  x{r['calls_per_step']:.0f}  {r['name']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--tune", action="store_true", help="time candidate tile configs first and use the best"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also E in {8,64,128,256} x tokens in {4k,16k,32k}"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU times of one triton step")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    cli = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not cli.smoke:
        raise SystemExit("bench_moe needs a CUDA GPU (or --smoke)")
    base = SMOKE if cli.smoke else T2
    result: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    try:
        import transformers
        import triton

        result |= {"transformers": transformers.__version__, "triton": triton.__version__}
    except ImportError:
        pass
    from veomni.kernels.moe_experts import configs as table

    if cli.tune:
        result["tune"] = tune(base, device, cli.workers, cli.reps)
        if device == "cuda":
            table.SM90_HALF.update({k: _cfg_dict(c) for k, c in result["tune"]["best"].items()})
    result["configs"] = {k: table.kernel_config(k, torch.bfloat16, torch.device(device)) for k in table.KINDS}
    shapes = [base]
    if cli.sweep:
        sizes = [(8, 4), (16, 2), (32, 1)] if cli.smoke else [(4096, 0), (16384, 0), (32768, 0)]
        for experts in [2, 4, 8] if cli.smoke else [8, 64, 128, 256]:
            for tokens, _ in sizes:
                shape = base | {"experts": experts, "tokens": tokens}
                if shape != base:
                    shapes.append(shape)
        if device == "cuda":  # compile the new expert counts' kernels in parallel before timing
            new_e = {s["experts"]: s for s in shapes if s["experts"] != base["experts"]}
            with _pool(min(cli.workers, len(new_e) or 1)) as pool:
                warm = [
                    pool.submit(_warm_shape, s | {"tokens": 1024}, dict(table.SM90_HALF))
                    for s in new_e.values()
                ]
                result["warm_errors"] = [f.result() for f in warm if f.result()]
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, device, with_eager=shape == base, reps=cli.reps)
        with open(cli.out, "w") as f:  # partial results survive a timeout
            json.dump(result | {"rows": rows}, f, indent=2)
    result["rows"] = rows
    if cli.profile and device == "cuda":
        try:
            result["profile"] = profile_triton(base)
        except Exception as err:  # noqa: BLE001 - the timings above are the result; the profile is extra
            result["profile_error"] = f"{type(err).__name__}: {err}"[:300]
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{'impl':14s} {'E':>4s} {'tokens':>6s} {'ms':>9s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'vs grouped_mm':>13s} {'vs eager':>9s} {'MiB':>7s}"
    )
    for r in rows:
        if "ms" not in r:
            print(f"{r['impl']:14s} {r['experts']:4d} {r['tokens']:6d}  {r.get('error')}")
            continue
        print(
            f"{r['impl']:14s} {r['experts']:4d} {r['tokens']:6d} {r['ms']:9.3f} {r['fwd_ms']:8.3f} {r['tflops']:8.1f} "
            f"{r.get('speedup_vs_hf_grouped_mm', float('nan')):13.2f} {r.get('speedup_vs_hf_eager', float('nan')):9.2f} "
            f"{r.get('peak_extra_mib', float('nan')):7.0f}"
        )


if __name__ == "__main__":
    main()
