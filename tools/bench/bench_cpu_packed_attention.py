"""Packed-row attention on the CPU, fwd+bwd: veomni's ``sdpa`` (segment by segment) vs HF's ``sdpa`` path under the
block-diagonal causal mask that packed ``position_ids`` give it; JSON out.

Usage: ``python tools/bench/bench_cpu_packed_attention.py --out cpu_attn.json [--tiny]``

Each case is one packed row of ``seq`` tokens cut into documents of seeded random lengths (uniform in
``[1, 2 * mean_doc - 1]``, the last one cut to fit), as a packing collator makes them. Both contenders get the same
``[1, S, H, D]`` tensors; HF's gets its ``[1, 1, S, S]`` bool mask built once outside the timing (HF builds it once
per forward for all layers). Times are medians of ``--reps`` fwd+bwd calls (``bench_common.timed_row``); outputs
and input gradients are compared (relative Frobenius error). The CPU quickstarts' rows are the first case.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from veomni.kernels.attention import ATTENTION_FUNCTIONS
from veomni.kernels.attention.functions import allowed_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, rel_err, timed_row, worst, write_json  # noqa: E402

# (seq, query heads, KV heads, head dim, mean document length). The first is quickstart-vlm's language model and
# rows (1,024 tokens, ~56 per document); the others: longer documents, and a wider model over 4k rows.
CASES = ((1024, 4, 2, 32, 56), (1024, 4, 2, 32, 256), (4096, 16, 8, 64, 512))
TINY = ((48, 4, 2, 8, 6), (48, 2, 1, 8, 20))
AGREE = 1e-4  # fp32: both run ATen's CPU flash kernel, over different key sets


def doc_lengths(seq: int, mean_doc: int, seed: int) -> list[int]:
    """Seeded random document lengths that fill ``seq`` exactly."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], seq
    while left:
        n = min(left, int(torch.randint(1, 2 * mean_doc, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return lengths


def hf_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's sdpa attention on ``[1, S, H, D]`` tensors under a ``[1, 1, S, S]`` bool mask; ``[1, S, Hq, D]``."""
    module = types.SimpleNamespace(
        num_key_value_groups=q.shape[2] // k.shape[2], is_causal=True, training=True
    )
    out, _ = sdpa_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    return out  # HF returns [B, S, H, D]


def run_case(seq: int, heads: int, heads_kv: int, dim: int, mean_doc: int, reps: int) -> dict[str, Any]:
    """Both contenders on one packed row; times, agreement and the FLOPs ratio of mask vs segments."""
    lengths = doc_lengths(seq, mean_doc, seed=seq + mean_doc)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, dim, generator=gen) for h in (heads, heads_kv, heads_kv))
    grad = torch.randn(1, seq, heads, dim, generator=gen)
    mask = allowed_mask(seq, True, cu, q.device)[None, None]
    contenders = {
        "veomni_sdpa": lambda a, b, c: ATTENTION_FUNCTIONS["sdpa"](a, b, c, cu_seqlens=cu),
        "hf_sdpa_mask": lambda a, b, c: hf_packed(a, b, c, mask),
    }
    row: dict[str, Any] = {
        "seq": seq, "heads": heads, "heads_kv": heads_kv, "dim": dim, "mean_doc": mean_doc, "docs": len(lengths),
        # Scores each computes (causal halves both): S^2 for the mask, sum n_i^2 per segment.
        "score_ratio_mask_vs_segments": seq**2 / sum(n * n for n in lengths), "contenders": {},
    }  # fmt: skip
    kept: dict[str, list[torch.Tensor]] = {}
    for name, fn in contenders.items():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]

        def step(fn=fn, inputs=inputs) -> torch.Tensor:
            for t in inputs:
                t.grad = None
            out = fn(*inputs)
            out.backward(grad)
            return out

        out = step()
        kept[name] = [out.detach(), *(t.grad.clone() for t in inputs)]
        row["contenders"][name] = timed_row(step, lambda fn=fn, inputs=inputs: fn(*inputs), q.device, reps)
    errors = [rel_err(a, b) for a, b in zip(kept["veomni_sdpa"], kept["hf_sdpa_mask"], strict=True)]
    row["rel_err"] = dict(zip(("out", "dq", "dk", "dv"), errors, strict=True))
    row["agrees"] = worst(errors) < AGREE  # a NaN error (a broken gradient) never agrees
    times = row["contenders"]
    row["speedup_fwd_bwd"] = times["hf_sdpa_mask"]["ms"] / times["veomni_sdpa"]["ms"]
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes (the CPU test)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10; tiny 2)")
    cli = parser.parse_args(argv)
    reps = cli.reps or (2 if cli.tiny else 10)
    result = {
        **environment(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "cases": [run_case(*case, reps=reps) for case in (TINY if cli.tiny else CASES)],
    }
    write_json(cli.out, result)
    for row in result["cases"]:
        times = row["contenders"]
        print(
            f"S {row['seq']} H {row['heads']}/{row['heads_kv']} D {row['dim']} docs {row['docs']}: "
            f"veomni {times['veomni_sdpa']['ms']:.2f} ms, HF mask {times['hf_sdpa_mask']['ms']:.2f} ms, "
            f"{row['speedup_fwd_bwd']:.2f}x, agrees {row['agrees']}"
        )
    return result


if __name__ == "__main__":
    main()
