"""Diagnostic (GPU): FlashAttention 4's gradients against an fp32 eager oracle by head size, memory layout and
packing, calling ``flash_attn.cute`` directly (no veomni wrapper). Written when a tiny Qwen3 (head size 16, HF's
``[B, H, S, D]`` q/k/v seen through a transpose, packed) trained through ``flash_attn_4`` had wrong gradients
while the kernel test (head size 64, contiguous) passed. Result (H200, flash-attn-4 4.0.0b36, 2026-11-28): head
size 16 has wrong gradients in every layout (dq off by up to 100% of its largest value), 32/64/128 are right in
both layouts; veomni refuses to train head sizes below 32 with it. Prints one row per case and writes JSON.

    python3 tools/bench/diag_fa4_layouts.py --out fa4_layouts.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def _oracle(q, k, v, cu, causal):
    # fp32 attention per segment, GQA by repeat: [S, H, D] in, [S, H, D] out.
    outs = []
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        s = qs @ ks.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            s = s.masked_fill(
                torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


def case(head_dim: int, layout: str, packed: bool, causal: bool) -> dict:
    from flash_attn.cute import flash_attn_varlen_func

    gen = torch.Generator().manual_seed(head_dim)
    seq, hq, hkv = 128, 4, 2
    base = [torch.randn(1, h, seq, head_dim, generator=gen) for h in (hq, hkv, hkv)]
    grad_out = torch.randn(seq, hq, head_dim, generator=gen).cuda().bfloat16()
    cu = torch.tensor([0, 37, 101, 128] if packed else [0, 128], dtype=torch.int32, device="cuda")
    leaves = [t.cuda().bfloat16().requires_grad_() for t in base]
    if layout == "head_major":  # HF's [B, H, S, D] seen as [S, H, D] through a transpose, as veomni passes it
        q, k, v = (t.transpose(1, 2)[0] for t in leaves)
    else:
        q, k, v = (t.transpose(1, 2)[0].contiguous() for t in leaves)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=128, max_seqlen_k=128,
                                 causal=causal)  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = _oracle(*(t.transpose(1, 2)[0] for t in ref_leaves), cu, causal)
    ref.backward(grad_out.float())
    row = {"head_dim": head_dim, "layout": layout, "packed": packed, "causal": causal,
           "out": (out.float() - ref).abs().max().item()}  # fmt: skip
    for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_leaves, strict=True):
        row[name] = ((got.grad.float() - want.grad).abs().max() / want.grad.abs().max()).item()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    cli = p.parse_args()
    rows = []
    for head_dim, layout, packed, causal in itertools.product(
        (16, 32, 64, 128), ("contiguous", "head_major"), (False, True), (True, False)
    ):
        try:
            rows.append(case(head_dim, layout, packed, causal))
        except Exception as err:  # noqa: BLE001 - a refusal is a result here
            rows.append({"head_dim": head_dim, "layout": layout, "packed": packed, "causal": causal,
                         "error": f"{type(err).__name__}: {err}"[:200]})  # fmt: skip
        print(rows[-1], flush=True)
    with open(cli.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
