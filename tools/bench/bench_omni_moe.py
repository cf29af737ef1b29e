"""Qwen3-Omni-MoE thinker training steps: veomni's adapter against plain transformers on one mixed audio / image /
text batch, side by side in one process, JSON out.

    python3 tools/bench/bench_omni_moe.py --out omni_moe.json                       # 30B-A3B-class thinker, 1 GPU
    python3 tools/bench/bench_omni_moe.py --out smoke.json --tiny --steps 2 --warmup 1   # CPU smoke

Model: the released Qwen3-Omni-30B-A3B thinker's widths (text hidden 2,048, 32 query / 4 KV heads of 128, 128
experts x 768 top-8, vocabulary 152,064; ViT 1,152 wide, 16 heads; audio encoder 1,280 wide, 20 heads) at reduced
depth so that one GPU holds it: ``--text-layers`` (default 8 of 48), ``--vit-blocks`` (8 of 27, deepstack after
blocks 1/3/5) and ``--audio-layers`` (8 of 32): about 5.9 B parameters, 8 bytes each with bf16 parameters,
gradients and AdamW states, ~47 GB before activations (an 80 GB H100 holds it). Initialised once by plain
transformers (seeded), saved, and loaded by every contender; nothing downloaded.

Data (seeded, identical for all): ``--rows`` rows of ``--seq-len`` tokens, each with one clip of ``--audio-seconds``
s (``100 * seconds`` mel frames -> 13 tokens per second), one image of ``--image-side`` x ``--image-side`` patches
(``side**2 / 4`` tokens) and text; labels are the text tokens.

Contenders: ``veomni`` (`build_model` with the default OpsConfig: veomni attention incl. both towers' encoder varlen
entry, grouped-GEMM experts, fused RMSNorm / RoPE / SwiGLU / linear cross-entropy, load-balancing kernel) and ``hf``
(transformers' class, SDPA, its default experts implementation: ``grouped_mm`` in 5.23, torch's grouped GEMM).
All train bf16 parameters with AdamW; a step is forward (router aux
loss included) + backward + optimizer step. Reported: median step time, tokens/s, peak memory, the first step's
loss (they must agree to bf16 tolerance) and each contender's experts implementation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerForConditionalGeneration as Upstream,
)

from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.qwen3_omni_moe.towers import audio_token_count

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import environment, error_text, median_ms, release, write_json  # noqa: E402

# Placeholder ids of the released thinker (its tokenizer's); text tokens are drawn below them.
AUDIO, IMAGE, VIDEO, V_START, V_END, A_START, A_END = 151646, 151655, 151656, 151652, 151653, 151669, 151670
# --tiny: the same ids shifted down by TINY_SHIFT (order and spacing kept) to the top of a 1,056-token vocabulary.
# On a CPU the released 152,064-row embedding and head made bf16 matmuls most of the smoke run's time.
TINY_SHIFT, TINY_VOCAB = AUDIO - 1000, 1056
CONTENDERS = ("veomni", "hf", "hf_grouped_mm")


def placeholders(config: Qwen3OmniMoeThinkerConfig) -> tuple[int, ...]:
    """``(AUDIO, IMAGE, VIDEO, V_START, V_END, A_START, A_END)`` as ``config`` numbers them."""
    shift = AUDIO - config.audio_token_id
    return tuple(i - shift for i in (AUDIO, IMAGE, VIDEO, V_START, V_END, A_START, A_END))


def thinker_config(args: argparse.Namespace) -> Qwen3OmniMoeThinkerConfig:
    """The 30B-A3B thinker's widths at the requested depths, or a CPU-sized one for smoke runs."""
    shift = TINY_SHIFT if args.tiny else 0
    ids = dict(audio_token_id=AUDIO - shift, image_token_id=IMAGE - shift, video_token_id=VIDEO - shift,
               audio_start_token_id=A_START - shift, vision_start_token_id=V_START - shift)  # fmt: skip
    if args.tiny:
        return Qwen3OmniMoeThinkerConfig(
            text_config={"vocab_size": TINY_VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                         "num_experts_per_tok": 2, "intermediate_size": 128,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]}},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": 64, "deepstack_visual_indexes": [0]},
            audio_config={"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2,
                          "encoder_ffn_dim": 64, "d_model": 32, "output_dim": 64, "downsample_hidden_size": 16},
            **ids,
        )  # fmt: skip
    return Qwen3OmniMoeThinkerConfig(
        text_config={"vocab_size": 152064, "hidden_size": 2048, "num_hidden_layers": args.text_layers,
                     "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                     "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                     "intermediate_size": 6144, "max_position_embeddings": 65536,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20]}},
        vision_config={"depth": args.vit_blocks, "out_hidden_size": 2048, "deepstack_visual_indexes": [1, 3, 5]},
        audio_config={"encoder_layers": args.audio_layers, "output_dim": 2048},
        **ids,
    )  # fmt: skip


def mixed_batch(config: Qwen3OmniMoeThinkerConfig, args: argparse.Namespace, device: torch.device) -> dict:
    """Rows of ``seq_len`` tokens, each: text, one audio clip, text, one image, text (module docstring)."""
    gen = torch.Generator().manual_seed(args.seed)
    frames = int(args.audio_seconds * 100)
    audio_tokens = int(audio_token_count(frames))
    side = args.image_side
    image_tokens = side * side // 4
    fixed = 4 + audio_tokens + image_tokens
    if fixed + 8 > args.seq_len:
        raise SystemExit(
            f"--seq-len {args.seq_len} cannot hold {audio_tokens} audio + {image_tokens} image tokens"
        )
    audio, image, _, v_start, v_end, a_start, a_end = placeholders(config)
    rows = []
    for _ in range(args.rows):
        text = torch.randint(0, audio - 1, (args.seq_len - fixed,), generator=gen)
        third = text.shape[0] // 3
        rows.append(torch.cat([
            text[:third], torch.tensor([a_start]), torch.full((audio_tokens,), audio), torch.tensor([a_end]),
            text[third:2 * third], torch.tensor([v_start]), torch.full((image_tokens,), image), torch.tensor([v_end]),
            text[2 * third:],
        ]))  # fmt: skip
    input_ids = torch.stack(rows)
    vc = config.vision_config
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.masked_fill(input_ids >= audio - 1, -100),
        "input_features": torch.randn(args.rows, config.audio_config.num_mel_bins, frames, generator=gen),
        "feature_attention_mask": torch.ones(args.rows, frames, dtype=torch.long),
        "pixel_values": torch.randn(args.rows * side * side, width, generator=gen),
        "image_grid_thw": torch.tensor([[1, side, side]] * args.rows),
    }
    return {k: v.to(device) for k, v in batch.items()}


def load_contender(name: str, path: str, device: torch.device) -> torch.nn.Module:
    if name == "veomni":
        ops = OpsConfig() if device.type == "cuda" else OpsConfig(attention="sdpa", moe_experts="torch")
        return build_model(
            path, weights=path, ops=ops, dtype=torch.bfloat16, device=device, task="any_to_any"
        )
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; expected one of {CONTENDERS}")
    extra = {"experts_implementation": "grouped_mm"} if name == "hf_grouped_mm" else {}
    return Upstream.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa", **extra).to(
        device
    )


def run_contender(name: str, path: str, batch: dict, args: argparse.Namespace, device: torch.device) -> dict:
    model = load_contender(name, path, device)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
    losses = []

    def step() -> None:
        loss = model(**batch, output_router_logits=True).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(step, device, args.warmup, args.steps)
    row = {
        "contender": name,
        "median_step_ms": ms,
        "tokens_per_s": batch["input_ids"].numel() / (ms / 1e3),
        "first_loss": losses[0],
        "experts_implementation": model.config.text_config._experts_implementation,
    }
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized thinker (smoke test)")
    p.add_argument(
        "--contenders", default="veomni,hf", help=f"comma list, run in this order, of {CONTENDERS}"
    )
    p.add_argument("--text-layers", type=int, default=8)
    p.add_argument("--vit-blocks", type=int, default=8)
    p.add_argument("--audio-layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--audio-seconds", type=float, default=10.0)
    p.add_argument("--image-side", type=int, default=32, help="patches per side (32: 512x512 px, 256 tokens)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown or not args.contenders:
        p.error(f"--contenders: unknown {unknown} (choose from {CONTENDERS})" if unknown else "--contenders is empty")  # fmt: skip
    if args.tiny and args.seq_len == 4096:
        args.seq_len, args.audio_seconds, args.image_side = 256, 1.5, 8
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = thinker_config(args)
    result: dict[str, Any] = {"bench": "omni_moe_thinker_step", "args": vars(args), "env": environment(device),
                              "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(args.seed)
        Upstream(config).to(torch.bfloat16).save_pretrained(path)
        batch = mixed_batch(config, args, device)
        result["tokens_per_step"] = batch["input_ids"].numel()
        for name in args.contenders:
            try:
                result["rows"].append(run_contender(name, path, batch, args, device))
            except Exception as err:  # one contender failing must not lose the others' numbers
                traceback.print_exc()
                result["rows"].append({"contender": name, "error": error_text(err)})
            release(device)
    by_name = {r["contender"]: r for r in result["rows"] if "error" not in r}
    if "veomni" in by_name and "hf" in by_name:
        result["speedup_vs_hf"] = by_name["veomni"]["tokens_per_s"] / by_name["hf"]["tokens_per_s"]
    write_json(args.out, result)
    print(result)
    return result


if __name__ == "__main__":
    main()
