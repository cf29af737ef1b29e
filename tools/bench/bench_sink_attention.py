"""Attention with sinks fwd+bwd at gpt-oss's shapes: veomni's sink-capable backends vs transformers' eager gpt-oss
attention, JSON out.

    python tools/bench/bench_sink_attention.py --out sinks.json [--seqs 4096,8192] [--size full|tiny]

Shapes (``--size full``, bf16 on CUDA): gpt-oss's attention, 64 query heads, 8 KV heads, head dim 64, one learned
sink logit per query head, batch 1. Every length runs as both of gpt-oss's layer types (``sliding``: a causal
window of 128 tokens, the alternate layers; ``full``: causal) and both layouts (one document; packed documents
of seeded random lengths, the row's last one cut to fit). ``--size tiny``: 8 / 2 heads of 16 dims, window 8,
lengths 64 and 96, fp32 on the CPU (the parity check the tests run).

Contenders, in this order:

- ``hf_eager``: ``transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward`` as ``GptOssAttention``
  calls it: q/k/v as ``[B, H, S, D]`` views of ``[B, S, H, D]`` tensors, an additive mask ``[B, 1, S, S]`` in the
  compute dtype (0 where allowed, the dtype's min elsewhere: causal, window, documents), ``module.sinks`` a leaf in
  the compute dtype, dropout 0.0 in training mode. The mask is built once, outside the timed step (HF builds it
  once per forward and shares it across the layers of a type).
- ``veomni_<backend>`` for every registered attention backend that implements both sinks and sliding windows
  (``eager``, ``sdpa``, ``flex`` today): ``fn(q, k, v, causal=True, cu_seqlens=..., max_seqlen=..., scale=D**-0.5,
  window=..., sinks=...)`` on ``[B, S, H, D]``; each builds its own mask or block mask inside the call, as in the
  model (flex is compiled once per process; dynamo's recompile limit is raised to 64 so that every configuration
  runs the compiled kernel). Backends lacking either feature are listed in ``backends_without_sinks``; those this
  hardware cannot run (flex on CPU: no backward there) are skipped rows with the reason.

A step is the forward and ``torch.autograd.grad`` for q, k, v and the sinks with the same seeded upstream gradient.
Reported per row: median fwd+bwd ms, forward ms (no_grad), peak extra memory of one step (allocator peak minus
what was allocated before: inputs and the HF mask excluded), ``speedup_vs_hf_eager`` (HF ms / ours ms),
``peak_ratio_vs_hf_eager``, and the max absolute (and relative Frobenius) error of the output and of each gradient
against the reference: the same HF eager formula in fp32 on fp32 copies of the inputs, one KV head and its query
heads at a time (bounded memory), forward and backward.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common lives beside this script
from bench_common import (  # noqa: E402
    environment,
    error_text,
    max_abs,
    measured_call,
    rel_err,
    release,
    timed_row,
    write_json,
)

SIZES: dict[str, dict[str, Any]] = {
    "full": {"q_heads": 64, "kv_heads": 8, "head_dim": 64, "window": 128, "seqs": (4096, 8192)},
    "tiny": {"q_heads": 8, "kv_heads": 2, "head_dim": 16, "window": 8, "seqs": (64, 96)},
}
NEEDED = frozenset({"sinks", "sliding_window"})
GRADS = ("dq", "dk", "dv", "dsinks")


def doc_lengths(seq: int, seed: int) -> list[int]:
    """Seeded document lengths, each in ``[seq // 8, seq // 2]`` except the last (cut to fill); they sum to seq."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        n = int(torch.randint(seq // 8, seq // 2 + 1, (1,), generator=gen))
        lengths.append(min(n, seq - sum(lengths)))
    return lengths


def allowed(seq: int, lengths: Sequence[int], window: int | None, device: torch.device) -> torch.Tensor:
    """Bool ``[S, S]``: query ``i`` may see key ``j`` (same document, ``j <= i``, and ``i - j < window`` if set)."""
    pos = torch.arange(seq, device=device)
    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    dist = pos[:, None] - pos[None, :]
    keep = (doc[:, None] == doc[None, :]) & (dist >= 0)
    return keep & (dist < window) if window is not None else keep


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's eager mask ``[1, 1, S, S]`` in ``dtype``: 0 where ``keep``, ``finfo(dtype).min`` elsewhere."""
    zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return zeros.masked_fill(~keep, torch.finfo(dtype).min)[None, None]


def make_inputs(
    size: dict[str, Any], seq: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Seeded leaves ``q [1, S, Hq, D]``, ``k``/``v [1, S, Hkv, D]``, ``sinks [Hq]`` and the upstream ``grad``."""
    gen = torch.Generator(device=device).manual_seed(seq)
    hq, hkv, d = size["q_heads"], size["kv_heads"], size["head_dim"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    return {
        "q": randn(1, seq, hq, d).requires_grad_(),
        "k": randn(1, seq, hkv, d).requires_grad_(),
        "v": randn(1, seq, hkv, d).requires_grad_(),
        "sinks": randn(hq).requires_grad_(),
        "grad": randn(1, seq, hq, d),
    }


def hf_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """transformers' gpt-oss eager attention on ``[B, S, H, D]`` tensors (passed as the model's ``[B, H, S, D]``
    views); ``sinks [Hq]``; ``mask [B, 1, S, S]`` additive. Returns ``[B, S, Hq, D]`` in q's dtype."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[2] // k.shape[2], training=True)
    out, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scaling=scale, dropout=0.0
    )
    return out


def reference(inputs: dict[str, torch.Tensor], keep: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """fp32 HF eager attention and its gradients (``out``, dq, dk, dv, dsinks), one KV head's query heads at a time."""
    q, k, v, sinks, grad = (inputs[n].detach().float() for n in ("q", "k", "v", "sinks", "grad"))
    mask = additive_mask(keep, torch.float32)
    group = q.shape[2] // k.shape[2]
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("out", *GRADS)}
    for h in range(k.shape[2]):
        heads = slice(h * group, (h + 1) * group)
        leaves = [
            t.clone().requires_grad_()
            for t in (q[:, :, heads], k[:, :, h : h + 1], v[:, :, h : h + 1], sinks[heads])
        ]
        out = hf_eager(*leaves, mask, scale)
        grads = torch.autograd.grad(out, leaves, grad[:, :, heads])
        parts["out"].append(out.detach())
        for name, g in zip(GRADS, grads, strict=True):
            parts[name].append(g)
    return {n: torch.cat(p, dim=0 if n == "dsinks" else 2) for n, p in parts.items()}


def contenders(device: torch.device) -> tuple[list[tuple[str, Callable | None, str | None]], dict[str, list]]:
    """``[(name, attention fn or None, skip reason or None)]`` and the backends lacking sinks or windows."""
    from veomni.kernels import KERNELS, detect_hardware

    rows: list[tuple[str, Callable | None, str | None]] = [("hf_eager", None, None)]
    lacking: dict[str, list[str]] = {}
    hardware = detect_hardware()
    for backend in KERNELS.backends("attention"):
        spec = KERNELS.get("attention", "default", backend)
        missing = sorted(NEEDED - spec.capabilities)
        if missing:
            lacking[backend] = missing
            continue
        problem = spec.requires.unmet(hardware)
        rows.append((f"veomni_{backend}", None if problem else spec.factory(), problem))
    return rows, lacking


def run_config(seq: int, layer: str, packed: bool, cli: Any, emit: Callable[[dict], None]) -> dict[str, Any]:
    """Every contender on one (length, layer type, layout); ``emit(config)`` after each row."""
    size, device, dtype = cli.size_spec, cli.device, cli.dtype
    window = size["window"] if layer == "sliding" else None
    lengths = doc_lengths(seq, seed=seq + 1) if packed else [seq]
    config: dict[str, Any] = {"seq": seq, "layer": layer, "window": window, "packed": packed}
    config["doc_lens"] = lengths
    config["rows"] = rows = []
    inputs = make_inputs(size, seq, dtype, device)
    scale = size["head_dim"] ** -0.5
    keep = allowed(seq, lengths, window, device)
    try:
        ref = reference(inputs, keep, scale)
    except Exception as err:  # noqa: BLE001 - without a reference the timings still stand
        ref, config["reference_error"] = None, error_text(err)
    release(device)
    hf_mask = additive_mask(keep, dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kwargs = {"causal": True, "cu_seqlens": cu if packed else None, "max_seqlen": max(lengths)}
    kwargs |= {"scale": scale, "window": window}
    leaves = [inputs[n] for n in ("q", "k", "v", "sinks")]
    for name, fn, skipped in cli.contenders:
        row: dict[str, Any] = {"impl": name}
        rows.append(row)
        if skipped:
            row["skipped"] = skipped
            emit(config)
            continue
        if fn is None:
            forward = lambda: hf_eager(*leaves, hf_mask, scale)  # noqa: E731
        else:
            forward = lambda fn=fn: fn(*leaves[:3], sinks=leaves[3], **kwargs)  # noqa: E731

        def step(forward: Callable[[], torch.Tensor] = forward) -> tuple[torch.Tensor, tuple]:
            out = forward()
            return out, torch.autograd.grad(out, leaves, inputs["grad"])

        try:
            (out, grads), first_ms, _ = measured_call(step, device)
            if ref is not None:
                got = {"out": out.detach(), **dict(zip(GRADS, grads, strict=True))}
                row["errors"] = {
                    n: {"max_abs": max_abs(got[n], ref[n]), "rel": rel_err(got[n], ref[n])} for n in ref
                }
            del out, grads
            row |= {"first_call_ms": first_ms, **timed_row(step, forward, device, cli.reps)}
        except Exception as err:  # noqa: BLE001 - an OOM or an unsupported path is a result
            row["error"] = error_text(err)
        release(device)
        emit(config)
    hf = rows[0]
    for row in rows[1:]:
        if "ms" in row and "ms" in hf:
            row["speedup_vs_hf_eager"] = hf["ms"] / row["ms"]
            if row.get("peak_extra_mib") and hf.get("peak_extra_mib"):
                row["peak_ratio_vs_hf_eager"] = row["peak_extra_mib"] / hf["peak_extra_mib"]
    return config


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", choices=tuple(SIZES), default="full", help="tiny: small fp32 shapes on CPU")
    parser.add_argument(
        "--seqs", default=None, help="comma-separated lengths (default 4096,8192; tiny 64,96)"
    )
    parser.add_argument("--layers", default="sliding,full", help="layer types: sliding (window), full")
    parser.add_argument("--layouts", default="single,packed", help="single document and/or packed documents")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10; tiny 3)")
    parser.add_argument("--device", default=None, help="default: cuda if available (tiny: cpu)")
    cli = parser.parse_args(argv)
    tiny = cli.size == "tiny"
    cli.size_spec = SIZES[cli.size]
    cli.seqs = [int(s) for s in cli.seqs.split(",")] if cli.seqs else list(cli.size_spec["seqs"])
    cli.layers = [x for x in cli.layers.split(",") if x]
    cli.layouts = [x for x in cli.layouts.split(",") if x]
    if set(cli.layers) - {"sliding", "full"} or set(cli.layouts) - {"single", "packed"}:
        parser.error("--layers takes sliding,full and --layouts single,packed")
    if any(s < 16 for s in cli.seqs):
        parser.error(f"--seqs must be >= 16 (packed documents are seq/8 to seq/2 long), got {cli.seqs}")
    cli.reps = cli.reps or (3 if tiny else 10)
    cli.device = torch.device(cli.device or ("cpu" if tiny or not torch.cuda.is_available() else "cuda"))
    if not tiny and cli.device.type != "cuda":
        parser.error("--size full needs a CUDA GPU (use --size tiny on CPU)")
    cli.dtype = torch.float32 if tiny else torch.bfloat16
    return cli


def raise_recompile_limit(limit: int) -> int:
    """Let compiled flex keep one graph per (layer type, layout) and length: 2 x 2 x 2 by default, at torch's
    default limit of 8 per function, past which dynamo would silently run flex unfused. Returns the limit set."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    return config.recompile_limit


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cli = parse_args(argv)
    cli.contenders, lacking = contenders(cli.device)
    recompile_limit = raise_recompile_limit(64)
    result: dict[str, Any] = {
        **environment(cli.device), "size": cli.size, "dtype": str(cli.dtype),
        "shape": {k: v for k, v in cli.size_spec.items() if k != "seqs"}, "backends_without_sinks": lacking,
        "dynamo_recompile_limit": recompile_limit,
        "configs": [],
    }  # fmt: skip
    started = time.perf_counter()
    for seq in cli.seqs:
        for layer in cli.layers:
            for layout in cli.layouts:
                index = len(result["configs"])

                def emit(config: dict[str, Any], index: int = index) -> None:
                    result["configs"][index:] = [config]
                    write_json(cli.out, result)

                emit(run_config(seq, layer, layout == "packed", cli, emit))
    result["wall_s"] = time.perf_counter() - started
    write_json(cli.out, result)
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'seq':>6s} {'layer':8s} {'docs':>4s} {'impl':15s} {'ms':>9s} {'fwd ms':>8s} {'MiB':>8s} {'vs HF':>6s} "
          f"{'err out':>8s} {'err dq':>8s} {'err dk':>8s} {'err dv':>8s} {'err ds':>8s}")  # fmt: skip
    for c in result["configs"]:
        for r in c["rows"]:
            head = f"{c['seq']:6d} {c['layer']:8s} {len(c['doc_lens']):4d} {r['impl']:15s}"
            if "ms" not in r:
                print(f"{head}  {r.get('skipped') or r.get('error')}")
                continue
            errs = r.get("errors", {})
            cols = " ".join(
                f"{errs[n]['max_abs']:8.1e}" if n in errs else f"{'-':>8s}" for n in ("out", *GRADS)
            )
            peak = r["peak_extra_mib"] if r["peak_extra_mib"] is not None else float("nan")
            print(f"{head} {r['ms']:9.3f} {r['fwd_ms']:8.3f} {peak:8.0f} "
                  f"{r.get('speedup_vs_hf_eager', float('nan')):6.2f} {cols}")  # fmt: skip


if __name__ == "__main__":
    main()
