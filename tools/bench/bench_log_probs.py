"""Per-token log-probs (+ entropy) from the LM head, fwd+bwd: veomni's log_probs op vs Liger's fused linear CE.

    python tools/bench/bench_log_probs.py --out log_probs.json [--size full|tiny] [--reps 7]
        [--contenders triton,triton_entropy,chunked_entropy,ce_triton,liger_ce,eager_entropy]

Shape: ``--size full`` is T3 (16,384 tokens, H = 2048, V = 151,936, bf16, BENCHMARKS.md) on CUDA; ``--size tiny``
is a CPU smoke run (64 tokens, H = 32, V = 300, fp32; the Triton contenders then need ``TRITON_INTERPRET=1``).
A tenth of the targets are ``-100``. Contenders, in this order:

- ``triton`` / ``triton_entropy``: veomni's fused ``log_probs`` (entropy off / on);
- ``chunked_entropy``: the portable plain-torch ``log_probs`` backend, entropy on;
- ``ce_triton``: veomni's fused linear cross-entropy (the same LM-head work with a scalar loss; its gradients
  are formed in forward, three GEMMs per chunk where log_probs needs four);
- ``liger_ce``: liger-kernel's ``LigerFusedLinearCrossEntropyFunction`` (``reduction="sum"``), the T3 peer;
- ``eager_entropy``: the eager oracle (fp32 ``[T, V]`` logits; may OOM at T3, which is then its row).

A log-probs step is ``logps, ent = fn(h, w, y); ((logps * g1).sum() + (ent * g2).sum()).backward()`` with fixed
random per-token ``g1, g2`` (as a DPO / policy-gradient loss weighs tokens); a CE step is
``loss, n = fn(h, w, y); loss.backward()``. ``.grad`` is reset to None first. Reported per contender: median
fwd+bwd ms (CUDA events; ``perf_counter`` on CPU), peak extra memory of one step (CUDA; allocator peak minus what
was allocated before, so the gradients it leaves count), ``ms_vs_liger`` / ``mem_vs_liger``, and for log-probs
contenders the largest absolute error of logps and entropy against the chunked backend's no-grad forward. A
contender that fails is a row with ``error``; the others still run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common lives beside this script
from bench_common import environment, error_text, measured_call, median_ms, release, write_json  # noqa: E402

from veomni.kernels.log_probs import chunked as lp_chunked  # noqa: E402
from veomni.kernels.log_probs import eager as lp_eager  # noqa: E402

# (tokens, hidden, vocab, dtype, device)
SHAPES: dict[str, tuple[int, int, int, torch.dtype, str]] = {
    "full": (16_384, 2048, 151_936, torch.bfloat16, "cuda"),
    "tiny": (64, 32, 300, torch.float32, "cpu"),
}
CONTENDERS = ("triton", "triton_entropy", "chunked_entropy", "ce_triton", "liger_ce", "eager_entropy")


def _log_probs_fn(name: str) -> tuple[Callable[..., Any], bool]:
    """(function, entropy) of a log-probs contender; imports lazily so a missing triton is that row's error."""
    if name.startswith("triton"):
        from veomni.kernels.log_probs import triton_impl

        return triton_impl.linear_log_probs, name.endswith("_entropy")
    if name == "chunked_entropy":
        return lp_chunked.linear_log_probs, True
    if name == "eager_entropy":
        return lp_eager.linear_log_probs, True
    raise ValueError(f"not a log-probs contender: {name!r}")


def _ce_fn(name: str) -> Callable[..., Any]:
    if name == "ce_triton":
        from veomni.kernels.cross_entropy import triton_impl as ce_triton

        return ce_triton.causal_lm_cross_entropy
    if name == "liger_ce":
        # Without liger-kernel this import fails, and the error is the row.
        from veomni.kernels.cross_entropy import liger_impl

        return liger_impl.causal_lm_cross_entropy
    raise ValueError(f"not a cross-entropy contender: {name!r}")


def make_inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Seeded ``h [T, H]``, ``w [V, H]`` (both requiring grad), targets ``[T]`` int64 with a tenth ignored, and
    per-token upstream gradients ``g_logp``, ``g_ent`` (fp32)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(n, hidden, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * (2.0 / hidden**0.5)).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[::10] = -100
    g_logp = torch.randn(n, generator=gen).to(device)
    g_ent = torch.randn(n, generator=gen).to(device)
    return {"h": h, "w": w, "y": y.to(device), "g_logp": g_logp, "g_ent": g_ent}


def run_contender(name: str, x: dict[str, Any], reference: tuple[torch.Tensor, torch.Tensor], cli: Any,
                  device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Time one contender; its JSON row."""
    h, w, y = x["h"], x["w"], x["y"]
    row: dict[str, Any] = {"impl": name}
    if name in ("ce_triton", "liger_ce"):
        ce = _ce_fn(name)

        def step() -> Any:
            h.grad = w.grad = None
            loss, _ = ce(h, w, y)
            loss.backward()
            return None

    else:
        fn, entropy = _log_probs_fn(name)
        row["entropy"] = entropy

        def step() -> Any:
            h.grad = w.grad = None
            logps, ent = fn(h, w, y, entropy=entropy)
            loss = (logps * x["g_logp"]).sum()
            if ent is not None:
                loss = loss + (ent * x["g_ent"]).sum()
            loss.backward()
            return logps.detach(), None if ent is None else ent.detach()

    out = step()  # compilation and first-call allocations stay out of the numbers
    h.grad = w.grad = None
    _, _, peak = measured_call(step, device)
    row["ms"] = median_ms(step, device, warmup=1, reps=cli.reps)
    row["peak_extra_mib"] = peak
    if out is not None:
        logps, ent = out
        row["logp_max_abs_err"] = (logps - reference[0]).abs().max().item() if logps.numel() else 0.0
        if ent is not None:
            row["entropy_max_abs_err"] = (ent - reference[1]).abs().max().item() if ent.numel() else 0.0
    h.grad = w.grad = None
    return row


def bench(cli: Any) -> dict[str, Any]:
    """Run every contender on one device; returns (and writes after each row) the JSON result."""
    n, hidden, vocab, dtype, device_type = SHAPES[cli.size]
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--size full needs a CUDA GPU; use --size tiny for the CPU smoke run")
    device = torch.device(device_type)
    x = make_inputs(n, hidden, vocab, dtype, device)
    with torch.no_grad():
        ref_logps, ref_ent = lp_chunked.linear_log_probs(x["h"], x["w"], x["y"], entropy=True)
    assert ref_ent is not None
    result: dict[str, Any] = {
        "bench": "log_probs",
        "env": environment(device),
        "shape": {"tokens": n, "hidden": hidden, "vocab": vocab},
        "dtype": str(dtype).removeprefix("torch."),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "rows": [],
    }
    for name in cli.contenders:
        try:
            row = run_contender(name, x, (ref_logps, ref_ent), cli, device)
        except Exception as err:  # OOM included: a failing contender is a result, not a crash
            x["h"].grad = x["w"].grad = None
            row = {"impl": name, "error": error_text(err)}
        release(device)
        result["rows"].append(row)
        write_json(cli.out, result)
    liger = next((r for r in result["rows"] if r["impl"] == "liger_ce" and "ms" in r), None)
    for row in result["rows"]:
        if liger is not None and "ms" in row:
            row["ms_vs_liger"] = row["ms"] / liger["ms"]
            if row["peak_extra_mib"] is not None and liger["peak_extra_mib"]:
                row["mem_vs_liger"] = row["peak_extra_mib"] / liger["peak_extra_mib"]
    write_json(cli.out, result)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--size", choices=sorted(SHAPES), default="full")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {CONTENDERS}"
    )
    cli = parser.parse_args(argv)
    cli.contenders = [c for c in cli.contenders.split(",") if c]
    unknown = sorted(set(cli.contenders) - set(CONTENDERS))
    if unknown or not cli.contenders:
        parser.error(f"--contenders: unknown {unknown} (choose from {list(CONTENDERS)})")
    if cli.reps < 1:
        parser.error(f"--reps must be >= 1, got {cli.reps}")
    return cli


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point: parse, run, print one line per contender."""
    cli = parse_args(argv)
    result = bench(cli)
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['impl']:>16}: {row['error']}")
        else:
            peak = row["peak_extra_mib"]
            print(f"{row['impl']:>16}: {row['ms']:9.2f} ms  peak extra "
                  f"{'n/a' if peak is None else f'{peak:.0f} MiB'}  vs liger {row.get('ms_vs_liger', float('nan')):.2f}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
