"""End-to-end training steps (T1): veomni against HF transformers (SDPA) and HF + Liger, side by side, JSON out.

    python3 tools/bench/bench_e2e.py --out e2e.json [--contenders veomni,veomni_compiled,hf,hf_liger] [--seq-len 4096]
    python3 tools/bench/bench_e2e.py --out smoke.json --tiny --seq-len 128 --steps 2 --warmup 1   # CPU smoke

One process, one device (CUDA when present, else CPU). Every contender starts from the same weights (a seeded
HF init of Qwen3-1.7B's config, saved once to a temporary directory and loaded by each) and trains on the same
packed micro-batches: one row of ``--seq-len`` tokens holding several documents of seeded random lengths,
``position_ids`` restarting per document, labels shifted per document (-100 at each document's last token).
The loss of an optimizer step is the token mean over all its micro-batches (``num_items_in_batch``).

``veomni`` / ``veomni_compiled`` follow the trainer's one-rank choice (`veomni.train.loop.one_rank_path`): a plain
bf16 module over fp32 master weights the optimizer steps (``--precision fp32``: plain fp32); ``--veomni-fsdp2``
puts them on FSDP2 over a one-rank mesh instead (the trainer's ``parallel.force_fsdp2``, the path measured before
2026-11-25's master-weights change).

Contenders run in a fixed order (veomni, veomni_compiled, veomni_plain, veomni_plain_compiled, hf, hf_liger):
Liger patches transformers' Qwen3 module globals for the rest of the process, so it must come last. The veomni
contenders set ``ops.compile`` explicitly: ``off``, or ``on`` for the ``*_compiled`` ones (every decoder block
``torch.compile``d with veomni's Triton kernels inside as custom ops). For those the JSON also records the
compile time (dynamo + backend seconds spent during the contender's steps, and the first step's wall time) and
the graphs compiled during warm-up and during the timed steps (``recompiles_after_warmup``, which should be 0). Each one: warm-up steps, then timed steps (synchronised per
step); tokens/s per GPU, MFU, peak memory (allocator peak since the contender was built), per-step losses and
grad norms. The model and optimizer are freed before the next contender.

MFU follows veomni.train.metrics (causal convention, recomputation not counted):
``(6 * active_matmul_params * tokens + 6 * L * Hq * D * sum(doc_len**2)) / (seconds * peak_flops)``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import profile_calls  # noqa: E402

from veomni.train.loop import setup_distributed  # noqa: E402
from veomni.train.metrics import active_matmul_params, attention_flops, peak_flops

sys.path.insert(
    0, os.path.dirname(os.path.abspath(__file__))
)  # the contenders module lives beside this script
from e2e_contenders import BUILDERS, Contender, Settings, _liger_problem  # noqa: E402

# Run order; hf_liger last (global patches).
# The default set; the *_graphs variants (train.cuda_graphs) run when named.
CONTENDERS = ("veomni", "veomni_compiled", "veomni_plain", "veomni_plain_compiled", "hf", "hf_liger")
OPTIONAL = ("veomni_compiled_graphs", "veomni_plain_compiled_graphs", "veomni_plain_graphs")
VEOMNI = tuple(c for c in CONTENDERS + OPTIONAL if c.startswith("veomni"))
IGNORE_INDEX = -100
GIB = 2**30

# Qwen3-1.7B's published config, written out so that nothing is downloaded.
QWEN3_1_7B: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40_960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "bos_token_id": 151_643, "eos_token_id": 151_645,
}  # fmt: skip
# The same architecture shrunk for CPU smoke runs (uneven sizes so nothing lines up by accident).
TINY: dict[str, Any] = QWEN3_1_7B | {
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


# ---------------------------------------------------------------- model and data


def qwen3_config(tiny: bool) -> Qwen3Config:
    """Qwen3-1.7B's config (or the tiny smoke config), with the KV cache off as in training."""
    return Qwen3Config(**(TINY if tiny else QWEN3_1_7B), use_cache=False)


def save_initial_weights(config: Qwen3Config, path: str, seed: int, device: torch.device) -> None:
    """Initialise a plain HF model (fp32, seeded) and ``save_pretrained`` it to ``path`` for every contender."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 2B parameters is much faster on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    del model
    _free(device)


def packed_batches(
    count: int, seq_len: int, vocab: int, min_doc: int, max_doc: int, seed: int
) -> list[dict[str, Any]]:
    """``count`` packed rows of ``seq_len`` random tokens, each split into documents of random lengths.

    Returns:
        dicts with ``input_ids``, ``position_ids``, ``labels`` int64 ``[1, S]`` (labels already shifted per
        document, -100 at each document's last token), ``cu_seqlens`` int32 ``[n + 1]``, ``max_seqlen`` int,
        ``doc_lens`` list[int] and ``num_valid`` int (labels != -100), all on the CPU.
    """
    if not 1 <= min_doc <= max_doc:
        raise ValueError(
            f"document lengths need 1 <= min_doc <= max_doc, got min_doc={min_doc}, max_doc={max_doc}"
        )
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        lens: list[int] = []
        while sum(lens) < seq_len:
            lens.append(min(int(rng.integers(min_doc, max_doc + 1)), seq_len - sum(lens)))
        ids = rng.integers(0, vocab, size=seq_len, dtype=np.int64)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        positions = np.empty(seq_len, dtype=np.int64)
        start = 0
        for n in lens:
            positions[start : start + n] = np.arange(n)
            labels[start : start + n - 1] = ids[start + 1 : start + n]  # the last token has no next one
            start += n
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        batches.append({
            "input_ids": torch.from_numpy(ids).view(1, -1),
            "position_ids": torch.from_numpy(positions).view(1, -1),
            "labels": torch.from_numpy(labels).view(1, -1),
            "cu_seqlens": torch.from_numpy(cu),
            "max_seqlen": max(lens),
            "doc_lens": lens,
            "num_valid": int((labels != IGNORE_INDEX).sum()),
        })  # fmt: skip
    return batches


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with its tensors (also those of nested dicts, e.g. ``vision_metadata``) on ``device``."""
    return {
        k: v.to(device) if isinstance(v, torch.Tensor) else _to(v, device) if isinstance(v, dict) else v
        for k, v in batch.items()
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(
    name: str, contender: Contender, steps: list[list[dict[str, Any]]], s: Settings
) -> dict[str, float] | None:
    """Two more steps under torch.profiler (`bench_common.profile_calls`); the top ops by device time go to
    ``<profile_dir>/<name>.txt``, the GPU-busy fraction and profiled step time are returned (CUDA only)."""

    def run() -> None:
        for micro_batches in steps:
            num_items = torch.full(
                (), sum(b["num_valid"] for b in micro_batches), device=s.device, dtype=torch.int64
            )
            contender.step(micro_batches, num_items)

    out = os.path.join(s.profile_dir, f"{name}.txt")
    profiled = profile_calls(run, s.device, out, steps=len(steps))
    print(
        f"[bench_e2e] profile of {name}:\n" + "\n".join(Path(out).read_text().splitlines()[:22]), flush=True
    )
    return profiled


def run_contender(
    name: str, s: Settings, steps: list[list[dict[str, Any]]], warmup: int, flops_per_step: list[float]
) -> dict[str, Any]:
    """Build ``name``, run ``steps`` (the first ``warmup`` untimed), free it; return its JSON record."""
    device = s.device
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    contender = BUILDERS[name](s)
    build_s = time.perf_counter() - t0
    losses, norms, seconds, issued = [], [], [], []
    compile_before = _compile_seconds()
    graphs_after_warmup = None
    for i, micro_batches in enumerate(steps):
        if i == warmup and contender.compile_stats is not None:
            graphs_after_warmup = contender.compile_stats.graphs
        num_items = torch.tensor(sum(b["num_valid"] for b in micro_batches), device=device, dtype=torch.int64)
        _sync(device)
        t0 = time.perf_counter()
        loss, norm = contender.step(micro_batches, num_items)
        issued.append(time.perf_counter() - t0)  # host time to queue the step (== the step when host-bound)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
        norms.append(norm)
    compile_record = _compile_record(contender, graphs_after_warmup, _compile_seconds() - compile_before)
    profiled = _profile(name, contender, steps[-2:], s) if s.profile_dir else None
    record: dict[str, Any] = dict(contender.info) | compile_record | (profiled or {})
    graphs = getattr(contender, "graphs", None)
    if graphs is not None:
        record["cuda_graph_runs"] = {
            "eager": graphs.eager_runs, "captures": graphs.captures, "replays": graphs.replays
        }  # fmt: skip
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        record["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        record["memory_before_build_gib"] = base / GIB
    del contender
    _free(device)
    if device.type == "cuda":
        record["memory_after_free_gib"] = torch.cuda.memory_allocated(device) / GIB
    timed = seconds[warmup:]
    tokens = sum(b["input_ids"].numel() for mb in steps[warmup:] for b in mb)
    peak = peak_flops(device)
    record |= {
        "build_s": build_s,
        "losses": [float(x) for x in losses],
        "grad_norms": [float(x) for x in norms],
        "final_loss": float(losses[-1]),
        "first_step_s": seconds[0],
        "step_s": timed,
        "median_step_ms": statistics.median(timed) * 1e3,
        "median_host_issue_ms": statistics.median(issued[warmup:]) * 1e3,
        "tokens_per_s_per_gpu": tokens / sum(timed),
        "mfu": sum(flops_per_step[warmup:]) / sum(timed) / peak if peak else None,
    }
    return record


# Dynamo's own timers (seconds, summed over calls): tracing plus backend compile of forward graphs, and the
# lazily compiled backward graphs.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def _compile_seconds() -> float:
    metrics = torch._dynamo.utils.compilation_time_metrics
    return sum(sum(metrics.get(name, ())) for name in _COMPILE_TIMERS)


def _compile_record(contender: Contender, graphs_after_warmup: int | None, seconds: float) -> dict[str, Any]:
    stats = contender.compile_stats
    if stats is None:
        return {"compiled_blocks": False}
    # None without warm-up steps: then every compile is in the timed steps, and nothing separates them.
    recompiles = None if graphs_after_warmup is None else stats.graphs - graphs_after_warmup
    return {
        "compiled_blocks": True,
        "compile_backend": stats.backend_name,
        "compile_s": seconds,
        "graphs_compiled": stats.graphs,
        "graphs_after_warmup": graphs_after_warmup,
        "recompiles_after_warmup": recompiles,
    }


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    pairs = [(ours, peer) for ours in VEOMNI for peer in ("hf", "hf_liger")]
    pairs += [("veomni_compiled", "veomni"), ("veomni_plain_compiled", "veomni_plain")]
    out = {}
    for name, peer in pairs:
        ours, theirs = results.get(name, {}), results.get(peer, {})
        if "tokens_per_s_per_gpu" not in ours or "tokens_per_s_per_gpu" not in theirs:
            continue
        ratio = {"tokens_per_s": ours["tokens_per_s_per_gpu"] / theirs["tokens_per_s_per_gpu"]}
        if "peak_memory_gib" in ours and "peak_memory_gib" in theirs:
            ratio["peak_memory"] = ours["peak_memory_gib"] / theirs["peak_memory_gib"]
        out[f"{name}/{peer}"] = ratio
    return out


# ---------------------------------------------------------------- CLI


def parse_ops(text: str) -> dict[str, str]:
    """``"attention=varlen,rope=eager"`` -> OpsConfig overrides; ValueError on a malformed item."""
    ops = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"ops overrides expect op=backend[,op=backend...], got {item!r} in {text!r}")
        ops[key.strip()] = value.strip()
    return ops


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True, help="where to write the JSON results")
    add("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    add("--tiny", action="store_true", help="a 2-layer toy Qwen3 instead of Qwen3-1.7B (CPU smoke)")
    add("--seq-len", type=int, default=4096, help="tokens per packed micro-batch row")
    add("--min-doc", type=int, default=None, help="shortest document (default seq_len // 16)")
    add("--max-doc", type=int, default=None, help="longest document (default seq_len // 2)")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--warmup", type=int, default=3, help="untimed optimizer steps first")
    add("--steps", type=int, default=10, help="timed optimizer steps")
    add("--seed", type=int, default=0, help="weights use seed, data seed + 1")
    add("--lr", type=float, default=1e-5)
    add("--weight-decay", type=float, default=0.1)
    add("--max-grad-norm", type=float, default=1.0)
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16: bf16 compute over fp32 master weights for everyone; fp32: fp32 throughout (parity)")  # fmt: skip
    add("--hf-master", choices=("fp32", "bf16"), default="fp32",
        help="the HF peers' parameters: fp32 with autocast (default) or pure bf16 parameters and optimizer "
             "state (the setting of BENCHMARKS.md's peer baseline rows)")  # fmt: skip
    add(
        "--veomni-no-reshard",
        action="store_true",
        help="FSDP2 reshard_after_forward=False for veomni (keeps gathered layers: one re-gather less); needs "
        "--veomni-fsdp2",
    )
    add(
        "--veomni-fsdp2",
        action="store_true",
        help="veomni/veomni_compiled through FSDP2 on a one-rank mesh (the trainer's parallel.force_fsdp2) instead "
        "of the trainer's one-rank default: a plain bf16 module over fp32 master weights (fp32: plain fp32)",
    )
    add(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the timed steps, profile 2 more per contender; tables go to DIR/<name>.txt",
    )
    add("--ac", choices=("none", "veomni", "all"), default="none",
        help="activation checkpointing for veomni only, or for every contender")  # fmt: skip
    add("--veomni-ops", default="", help="OpsConfig overrides, e.g. attention=varlen,rope=eager")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--tmpdir", default=None, help="where the initial weights are saved (default: system temp)")
    args = p.parse_args(argv)
    args.contenders = [c for c in filter(None, args.contenders.split(","))]
    unknown = sorted(set(args.contenders) - set(CONTENDERS + OPTIONAL))
    if unknown or not args.contenders:
        p.error(f"--contenders: unknown {unknown} (choose from {CONTENDERS})" if unknown else "--contenders is empty")  # fmt: skip
    for flag in ("seq_len", "grad_accum", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.hf_master == "bf16" and args.precision == "fp32":
        p.error("--hf-master bf16 contradicts --precision fp32")
    if args.veomni_no_reshard and not args.veomni_fsdp2:
        p.error(
            "--veomni-no-reshard sets FSDP2's reshard_after_forward: add --veomni-fsdp2 (one rank trains no FSDP2)"
        )
    try:
        args.veomni_ops = parse_ops(args.veomni_ops)
    except ValueError as err:
        p.error(f"--veomni-ops: {err}")
    if "compile" in args.veomni_ops:
        p.error(
            "--veomni-ops: compile is set per contender (veomni, veomni_plain: off; veomni_compiled, "
            "veomni_plain_compiled: on); choose them with --contenders"
        )
    args.min_doc = args.min_doc or max(1, args.seq_len // 16)
    args.max_doc = args.max_doc or max(args.min_doc, args.seq_len // 2)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write ``--out`` and print a table; returns the JSON object."""
    args = parse_args(argv)
    created_group = not dist.is_initialized()
    device = setup_distributed(args.device)
    try:
        if dist.get_world_size() != 1:
            raise SystemExit(
                f"bench_e2e runs in one process on one device; the world size is {dist.get_world_size()}"
            )
        return _run(args, device)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = qwen3_config(args.tiny)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    n_active = active_matmul_params(probe)
    del probe
    n_steps = args.warmup + args.steps
    cpu_batches = packed_batches(
        n_steps * args.grad_accum, args.seq_len, config.vocab_size, args.min_doc, args.max_doc, args.seed + 1
    )
    batches = [_to(b, device) for b in cpu_batches]
    steps = [batches[i * args.grad_accum : (i + 1) * args.grad_accum] for i in range(n_steps)]
    q_width = config.num_attention_heads * config.head_dim
    flops = [
        sum(6.0 * n_active * b["input_ids"].numel() + attention_flops(b["doc_lens"], config.num_hidden_layers, q_width)
            for b in mb)
        for mb in steps
    ]  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_e2e_", dir=args.tmpdir) as weights:
        save_initial_weights(config, weights, args.seed, device)
        settings = Settings(
            device=device, weights=weights, lr=args.lr, weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm, precision=args.precision, ac=args.ac, hf_master=args.hf_master,
            veomni_ops=args.veomni_ops, veomni_reshard=not args.veomni_no_reshard,
            veomni_fsdp2=args.veomni_fsdp2, profile_dir=args.profile,
        )  # fmt: skip
        order = [c for c in CONTENDERS if c.startswith("veomni")] + list(OPTIONAL) + ["hf", "hf_liger"]
        for name in order:  # the fixed order: Liger's global patches must come last
            if name not in args.contenders:
                continue
            problem = _liger_problem(device) if name == "hf_liger" else None
            if problem:
                results[name] = {"skipped": problem}
                continue
            print(f"[bench_e2e] {name} ...", file=sys.stderr, flush=True)
            try:
                results[name] = run_contender(name, settings, steps, args.warmup, flops)
            except Exception as err:  # noqa: BLE001 - a failing contender (OOM, say) is a result to report
                traceback.print_exc()
                results[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
                _free(device)
    peak = peak_flops(device)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "model": "tiny Qwen3 (smoke)" if args.tiny else "Qwen3-1.7B",
        "config": {k: v for k, v in (TINY if args.tiny else QWEN3_1_7B).items()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "data": {
            "tokens_per_step": args.seq_len * args.grad_accum,
            "docs_per_micro_batch": [len(b["doc_lens"]) for b in cpu_batches],
            "valid_labels_per_step": [sum(b["num_valid"] for b in mb) for mb in steps],
        },
        "mfu": {
            "formula": "(6 * active_matmul_params * tokens + 6 * layers * q_heads * head_dim * sum(doc_len**2)) "
                       "/ (seconds * peak_flops); veomni.train.metrics, causal convention, recompute not counted",
            "active_matmul_params": n_active,
            "peak_flops": peak,
            "flops_per_step": flops,
        },  # fmt: skip
        "contenders": results,
        "ratios": _ratios(results),
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    _print_table(result)
    return result


def _print_table(result: dict[str, Any]) -> None:
    print(f"{result['model']} on {result['device']}, {result['data']['tokens_per_step']} tokens/step")
    print(
        f"{'contender':22s} {'tok/s/gpu':>11s} {'MFU':>7s} {'peak GiB':>9s} {'step ms':>9s} {'loss[0]':>9s} {'final loss':>11s}"
    )
    for name, r in result["contenders"].items():
        if "tokens_per_s_per_gpu" not in r:
            print(f"{name:22s} {r.get('skipped') or r.get('error')}")
            continue
        mfu = f"{r['mfu'] * 100:6.1f}%" if r["mfu"] is not None else "    n/a"
        mem = f"{r['peak_memory_gib']:9.2f}" if "peak_memory_gib" in r else "      n/a"
        print(f"{name:22s} {r['tokens_per_s_per_gpu']:11,.0f} {mfu} {mem} {r['median_step_ms']:9.1f} "
              f"{r['losses'][0]:9.5f} {r['final_loss']:11.5f}")  # fmt: skip
        if r.get("compiled_blocks"):
            print(f"{'':22s} compiled ({r['compile_backend']}): {r['compile_s']:.1f} s compiling, "
                  f"{r['graphs_compiled']} graph(s), recompiles after warm-up: {r['recompiles_after_warmup']}")  # fmt: skip
    for pair, ratio in result["ratios"].items():
        parts = [f"tok/s x{ratio['tokens_per_s']:.3f}"]
        if "peak_memory" in ratio:
            parts.append(f"memory x{ratio['peak_memory']:.3f}")
        print(f"{pair}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
