"""Every registered kernel against the others of its (op, variant), side by side in one run, fwd+bwd, JSON out.

    python tools/bench/bench_kernels.py --out results.json [--ops rms_norm,rope]

Walks veomni's kernel registry, so a new backend is benchmarked as soon as it registers. Shapes are those of a
Qwen3-8B-class layer in bf16. Each row reports the median fwd+bwd time (triton.testing.do_bench), the peak memory
above the inputs, and the time ratio against eager measured in the same run. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from veomni.kernels import KERNELS, detect_hardware

DT = torch.bfloat16


def _t(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DT).requires_grad_(grad)


def _rope(rotary: int) -> Callable[[], tuple[tuple, dict]]:
    def build():
        cos_sin = torch.randn(2, 1, 4096, rotary, device="cuda", dtype=DT)
        q = _t(1, 4096, 32, 128).transpose(1, 2)  # HF's layout: a transposed view of the projection output
        k = _t(1, 4096, 8, 128).transpose(1, 2)
        return (q, k, cos_sin[0].cos(), cos_sin[1].sin()), {"rotary_dim": rotary}

    return build


SHAPES: dict[tuple[str, str], Callable[[], tuple[tuple, dict]]] = {
    ("rms_norm", "standard"): lambda: ((_t(16384, 4096), _t(4096), 1e-6), {}),
    ("rms_norm", "offset"): lambda: ((_t(16384, 4096), _t(4096), 1e-6), {}),
    ("rms_norm", "unweighted"): lambda: ((_t(16384, 4096), 1e-6), {}),
    ("rms_norm", "residual"): lambda: ((_t(16384, 4096), _t(16384, 4096), _t(4096), 1e-6), {}),
    ("rope", "full"): _rope(128),
    ("rope", "partial"): _rope(64),
    ("swiglu", "standard"): lambda: ((_t(16384, 12288), _t(16384, 12288)), {}),
    ("load_balancing_loss", "switch"): lambda: (([_t(16384, 128) for _ in range(4)], 128, 8), {}),
    ("attention", "default"): lambda: ((_t(1, 8192, 32, 128), _t(1, 8192, 8, 128), _t(1, 8192, 8, 128)), {}),
    # Wan2.1-T2V-1.3B self-attention at 480p x 81 frames: 32,760 tokens, 12 heads of 128, non-causal (T9).
    ("attention", "wan"): lambda: (
        (_t(1, 32760, 12, 128), _t(1, 32760, 12, 128), _t(1, 32760, 12, 128)),
        {"causal": False},
    ),
    # Qwen2.5-VL-7B's tower (16 heads of 80) on 16k packed patches; cos/sin rows per patch.
    ("rope_vision", "full"): lambda: (
        (_t(16384, 16, 80), _t(16384, 16, 80), *_t(2, 16384, 80, grad=False)),
        {},
    ),
    # Qwen2.5-VL-7B's language model (28 q / 4 kv heads of 128) with its mrope_section on an 8k row.
    ("rope", "mrope"): lambda: (
        (
            _t(1, 8192, 28, 128).transpose(1, 2),
            _t(1, 8192, 4, 128).transpose(1, 2),
            *_t(2, 3, 1, 8192, 128, grad=False),
        ),
        {"mrope_section": [16, 24, 24]},
    ),
}


def _outputs(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _outputs(item)]


def _step(fn, args, kwargs) -> None:
    outs = [o for o in _outputs(fn(*args, **kwargs)) if o.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


# Shapes timed with another variant's kernels: Wan's attention is the registry's default attention entry.
SPEC_VARIANT = {("attention", "wan"): "default"}


def bench_one(op: str, variant: str, backend: str, *, inductor: bool = False) -> dict:
    """Time one registered kernel on the shape ``SHAPES[(op, variant)]``; ``inductor``: ``torch.compile`` of it
    (what a compiled block would run)."""
    import triton.testing

    spec = KERNELS.get(op, SPEC_VARIANT.get((op, variant), variant), backend)
    problem = spec.requires.unmet(detect_hardware())
    row: dict = {"op": op, "variant": variant, "backend": f"{backend}+inductor" if inductor else backend}
    if problem:
        return row | {"skipped": problem}
    fn = spec.factory()
    if inductor:
        torch._dynamo.reset()
        fn = torch.compile(fn, dynamic=False)
    args, kwargs = SHAPES[(op, variant)]()
    try:
        _step(fn, args, kwargs)  # compile / autotune outside the timing
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(fn, args, kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ms = triton.testing.do_bench(lambda: _step(fn, args, kwargs), warmup=25, rep=100)
    except Exception as err:  # noqa: BLE001 - a failing backend is a result to report, not a crash
        return row | {"error": f"{type(err).__name__}: {err}"[:300]}
    return row | {"ms": ms, "peak_extra_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--ops", default="", help="comma-separated ops (default: all with a shape)")
    parser.add_argument(
        "--backends", default="", help="comma-separated backends (default: every registered one)"
    )
    parser.add_argument(
        "--variants", default="", help="comma-separated variants, e.g. wan (default: all with a shape)"
    )
    parser.add_argument(
        "--inductor", action="store_true", help="also time torch.compile of each eager oracle"
    )
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    wanted = set(filter(None, cli.ops.split(",")))
    backends = set(filter(None, cli.backends.split(",")))
    variants = set(filter(None, cli.variants.split(",")))
    rows = []
    for op, variant in SHAPES:
        if (wanted and op not in wanted) or (variants and variant not in variants):
            continue
        for backend in KERNELS.backends(op):
            if backends and backend not in backends:
                continue
            registered = {(s.op, s.variant, s.backend) for s in KERNELS.specs()}
            if (op, SPEC_VARIANT.get((op, variant), variant), backend) in registered:
                rows.append(bench_one(op, variant, backend))
                torch.cuda.empty_cache()
        # The eager formula as inductor fuses it inside a compiled block.
        if cli.inductor and op != "attention":
            rows.append(bench_one(op, variant, "eager", inductor=True))
            torch.cuda.empty_cache()
    eager_ms = {(r["op"], r["variant"]): r["ms"] for r in rows if r["backend"] == "eager" and "ms" in r}
    for r in rows:
        if "ms" in r and (r["op"], r["variant"]) in eager_ms:
            r["speedup_vs_eager"] = eager_ms[(r["op"], r["variant"])] / r["ms"]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": str(DT),
        "rows": rows,
    }
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in rows:
        detail = (
            f"{r['ms']:8.3f} ms  {r['peak_extra_mib']:9.1f} MiB  x{r.get('speedup_vs_eager', float('nan')):.2f}"
            if "ms" in r
            else r.get("skipped") or r.get("error")
        )
        print(f"{r['op']:20s} {r['variant']:10s} {r['backend']:13s} {detail}")


if __name__ == "__main__":
    main()
