"""LoRA training steps (T13): veomni's LoRA against HF transformers + PEFT (and + Liger), side by side, JSON out.

    python3 tools/bench/bench_lora.py --out lora.json [--contenders veomni_lora,veomni_lora_compiled,hf_peft,hf_peft_liger]
    python3 tools/bench/bench_lora.py --out smoke.json --tiny --seq-len 128 --steps 2 --warmup 1   # CPU smoke

One process, one device. Every contender loads the same base (a seeded bf16 init of Qwen3-8B's config, saved once)
and trains rank-16 adapters (alpha 32) on all linear layers of the decoder on the same packed rows (`bench_e2e`'s
``packed_batches``): the setting of BENCHMARKS.md's T13 peer rows. Reported per contender: tokens/s, peak memory,
per-step losses and grad norms (equal starting points: the first step's loss agrees across contenders), and
the ratios veomni / peer. MFU is not reported: a frozen base's backward skips the weight gradients, which the
6 * N convention would count.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402
import e2e_contenders  # noqa: E402
from bench_common import environment, write_json  # noqa: E402
from e2e_contenders import Settings  # noqa: E402
from lora_contenders import HFPeft, VeomniLora  # noqa: E402

from veomni.train.loop import setup_distributed  # noqa: E402

CONTENDERS = (
    "veomni_lora",
    "veomni_lora_compiled",
    "hf_peft",
    "hf_peft_liger",
)  # hf_peft_liger last (patches)
QWEN3_8B: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40_960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151_643, "eos_token_id": 151_645,
}  # fmt: skip


def register(rank: int, alpha: float) -> None:
    """Make `bench_e2e.run_contender` know the LoRA contenders."""
    e2e_contenders.BUILDERS.update({
        "veomni_lora": functools.partial(VeomniLora, rank=rank, alpha=alpha),
        "veomni_lora_compiled": functools.partial(VeomniLora, rank=rank, alpha=alpha, compile_setting="on"),
        "hf_peft": functools.partial(HFPeft, rank=rank, alpha=alpha, liger=False),
        "hf_peft_liger": functools.partial(HFPeft, rank=rank, alpha=alpha, liger=True),
    })  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True)
    add("--contenders", default=",".join(CONTENDERS))
    add("--tiny", action="store_true", help="bench_e2e's toy Qwen3 (CPU smoke)")
    add("--seq-len", type=int, default=4096)
    add("--warmup", type=int, default=3)
    add("--steps", type=int, default=10)
    add("--rank", type=int, default=16)
    add("--alpha", type=float, default=32.0)
    add("--lr", type=float, default=1e-4)
    add("--ac", choices=("none", "veomni", "all"), default="none")
    add("--veomni-ops", default="", help="OpsConfig overrides, e.g. attention=varlen")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        p.error(f"--contenders: unknown {unknown} (choose from {CONTENDERS})")
    args.veomni_ops = bench_e2e.parse_ops(args.veomni_ops)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = setup_distributed(args.device)
    register(args.rank, args.alpha)
    config = bench_e2e.qwen3_config(True) if args.tiny else Qwen3Config(**QWEN3_8B, use_cache=False)
    n_steps = args.warmup + args.steps
    seq = args.seq_len
    cpu = bench_e2e.packed_batches(
        n_steps, seq, config.vocab_size, max(1, seq // 16), max(1, seq // 2), args.seed + 1
    )
    steps = [[bench_e2e._to(b, device)] for b in cpu]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as weights:
        torch.manual_seed(args.seed)
        with torch.device(device):
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(weights)
        bench_e2e._free(device)
        settings = Settings(
            device=device, weights=weights, lr=args.lr, weight_decay=0.0, max_grad_norm=1.0, precision="bf16",
            ac=args.ac, hf_master="bf16", veomni_ops=args.veomni_ops,
        )  # fmt: skip
        for name in [c for c in CONTENDERS if c in args.contenders]:
            try:
                results[name] = bench_e2e.run_contender(name, settings, steps, args.warmup, [0.0] * n_steps)
                results[name].pop("mfu", None)
            except Exception as err:  # noqa: BLE001 - recorded, the other contenders still run
                results[name] = {"error": f"{type(err).__name__}: {err}"}
                bench_e2e._free(device)
            r = results[name]
            print(f"[bench_lora] {name}: {r.get('tokens_per_s_per_gpu', 0):,.0f} tok/s, "
                  f"peak {r.get('peak_memory_gib', float('nan')):.1f} GiB, losses {r.get('losses', r.get('error'))}",
                  flush=True)  # fmt: skip
    ratios = {}
    for ours in ("veomni_lora", "veomni_lora_compiled"):
        for peer in ("hf_peft", "hf_peft_liger"):
            a, b = results.get(ours, {}), results.get(peer, {})
            if "tokens_per_s_per_gpu" in a and "tokens_per_s_per_gpu" in b:
                ratios[f"{ours}/{peer}"] = {
                    "tokens_per_s": a["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"],
                    "peak_memory": a["peak_memory_gib"] / b["peak_memory_gib"]
                    if "peak_memory_gib" in a
                    else None,
                }
    out = {"bench": "lora", "args": {k: v for k, v in vars(args).items()}, "environment": environment(device),
           "model": "tiny" if args.tiny else "Qwen3-8B config (random bf16 init)", "results": results,
           "ratios": ratios}  # fmt: skip
    write_json(args.out, out)
    print(json.dumps(ratios, indent=1))
    return out


if __name__ == "__main__":
    main()
