"""Vision-language training steps (T8): veomni against HF transformers (SDPA) and HF + Liger on a Qwen3-VL-2B-class
(or, with ``--model qwen2_5_vl_7b``, a Qwen2.5-VL-7B-class) model with mixed image/text packed micro-batches, side by
side in one process, JSON out.

    python3 tools/bench/bench_vlm.py --out vlm.json [--contenders veomni,veomni_plain,hf,hf_liger] [--seq-len 8192]
    python3 tools/bench/bench_vlm.py --out smoke.json --tiny --seq-len 256 --steps 2 --warmup 1   # CPU smoke
    python3 tools/bench/bench_vlm.py --model qwen2_5_vl_7b --out vlm25.json --hf-master bf16 --precision bf16
    python3 tools/bench/bench_vlm.py --model qwen2_5_vl_7b --video-fraction 0.2 --out vlm25v.json --hf-master bf16 \
        --precision bf16   # clip conversations too (``VIDEO_TEMPORAL_PATCHES``)

Qwen2.5-VL-7B (``--model qwen2_5_vl_7b``): the published architecture (a 32-block windowed ViT of width 1280, patch
14, windows of 112 pixels with full attention at blocks 7/15/23/31; a 28-layer Qwen2 text model of width 3584);
veomni gets the window layout from the collator (`veomni.models.qwen2_5_vl.window.WindowIndex`, the trainer's
path), HF computes it in every forward. 8.3B parameters: on one 80 GB GPU only bf16 parameters and AdamW state
fit (``--hf-master bf16 --precision bf16`` for every contender), with ``--ac all`` (HF) / ``veomni`` for activations.

Qwen3.5 (``--model qwen3_5_9b_8l``): the hybrid VLM (Gated DeltaNet + gated attention, tower without deepstack) at
Qwen3.5-9B's widths, 8 of 32 text layers; veomni's Gated DeltaNet runs fla's kernels with the packing's
``cu_seq_lens`` (state reset per document), HF's runs fla too (flash-linear-attention installed) on what transformers
derives from the 4-row position ids. Off CUDA (``--tiny``) HF's Gated DeltaNet would call fla's CUDA-only kernels: run
the smoke with ``--contenders veomni,veomni_plain``. 4.2B parameters: use ``--hf-master bf16 --precision bf16`` on one
80 GB GPU, as for Qwen2.5-VL-7B.

Model: Qwen3-VL-2B-Instruct's published architecture (written inline, nothing downloaded; 24-block ViT of width
1024 with deepstack at blocks 5/11/17, a 28-layer Qwen3 text model of width 2048), initialised once by plain
transformers (seeded, fp32), saved, and loaded by every contender.

Data recipe (seeded; the same micro-batches for every contender): each micro-batch is one packed row of exactly
``--seq-len`` tokens. Samples are drawn until the row is full: with probability ``--image-fraction`` an image
conversation (a 16-96-token prompt, ``<|vision_start|>``, the image's ``h*w/4`` placeholder tokens,
``<|vision_end|>``, a 32-384-token answer), else a text conversation (a 32-256-token prompt, a 64-1024-token
answer); only answers are trained. Images have one of the sizes in ``IMAGE_SIZES`` (448x448 to 896x672 pixels,
patch 16, merge 2: 196 to 588 tokens each); pixel rows are seeded normal noise (the timing does not depend on
pixel values). A sample that does not fit is replaced by a text filler of exactly the remaining length. Rows go
through veomni's own collator (`veomni.train.data.multimodal.collate_multimodal`): 4-row ``[text; t; h; w]`` mrope
position ids from `veomni.models.qwen3_vl.positions.Qwen3VLPositions`, shifted labels per sample. Every contender
gets the same tensors: veomni its packing (``cu_seq_lens``) and HF the 4-row position ids, from which it builds a
packed causal mask for SDPA (HF's packed path without flash-attn, which the device image lacks).

MFU counts the ViT: ``flops_per_token * tokens + attention + vision_flops_per_patch * patches`` from
`veomni.train.tasks.VlmTask` (the LM's matmul FLOPs excluding the tower, causal attention per sample, the tower's
matmul FLOPs per patch; the tower's own attention scores not counted).

Contenders and settings are those of `bench_e2e.py` (see ``tools/bench/README.md``), with the image-text-to-text
classes: veomni (the trainer's one-rank default: a plain bf16 module over fp32 master weights; ``--veomni-fsdp2``:
FSDP2 on a one-rank mesh with mixed precision), veomni_compiled, veomni_plain (no FSDP2,
parameters in bf16 with ``--precision bf16``), veomni_plain_compiled, hf (SDPA, fp32 masters + autocast or pure
bf16 with ``--hf-master bf16``), hf_liger (``apply_liger_kernel_to_qwen3_vl``: RoPE, RMSNorm, fused linear CE).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen3VLConfig

from veomni.models.qwen2_5_vl.window import WindowIndex
from veomni.models.qwen2_vl.positions import Qwen2VLPositions
from veomni.models.qwen3_vl.positions import Qwen3VLPositions
from veomni.train.data.encode import Sample
from veomni.train.data.multimodal import MediaSample, collate_multimodal
from veomni.train.loop import setup_distributed
from veomni.train.metrics import attention_flops, peak_flops
from veomni.train.tasks.vision import VlmTask

sys.path.insert(
    0, os.path.dirname(os.path.abspath(__file__))
)  # bench_e2e and its contenders live beside this
from bench_e2e import _free, _ratios, _to, run_contender  # noqa: E402
from e2e_contenders import Settings, _liger_problem  # noqa: E402
from vlm_models import MODELS, vlm_config  # noqa: E402

CONTENDERS = ("veomni", "veomni_compiled", "veomni_plain", "veomni_plain_compiled", "hf", "hf_liger")
IGNORE_INDEX = -100
GIB = 2**30

# (height, width) in pixels, multiples of 16 * 2 and of 14 * 2: patch 16 (Qwen3-VL) and merge 2 make h*w/1024
# tokens each, patch 14 (Qwen2.5-VL) h*w/784.
IMAGE_SIZES = ((448, 448), (448, 672), (672, 448), (672, 672), (896, 672))
TINY_IMAGE_SIZES = ((64, 64), (64, 96), (96, 64))
# Clips (``--video-fraction``, Qwen2.5-VL): frames of one of the image sizes, this many temporal patches (2 frames
# each), sampled at VIDEO_FPS (the processor's second_per_grid_ts = temporal_patch_size / fps spaces their
# temporal position ids). 448x448 frames and 4 temporal patches: 1024 tokens, 4096 patches.
VIDEO_TEMPORAL_PATCHES, TINY_VIDEO_TEMPORAL_PATCHES, VIDEO_FPS = 4, 2, 2.0


def save_initial_weights(config: Qwen3VLConfig, path: str, seed: int, device: torch.device) -> None:
    """Initialise a plain HF model (fp32, seeded) and ``save_pretrained`` it to ``path`` for every contender."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    del model
    _free(device)


def _text_vocab(config: Qwen3VLConfig) -> int:
    """Random text ids stay below every vision token id (a stray placeholder would be an image token)."""
    special = (
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    return min(int(config.text_config.vocab_size), *(int(t) for t in special))


def _image_sample(
    rng: np.random.Generator,
    config: Qwen3VLConfig,
    size: tuple[int, int],
    positions: Qwen3VLPositions,
    index: int,
) -> Sample:
    vision = config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    grid = np.asarray([[1, size[0] // patch, size[1] // patch]], dtype=np.int64)
    patches = int(grid.prod())
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * patch * patch
    text_vocab = _text_vocab(config)
    prompt = rng.integers(3, text_vocab, int(rng.integers(16, 97)))
    answer = rng.integers(3, text_vocab, int(rng.integers(32, 385)))
    image = np.full(patches // merge**2, config.image_token_id)
    ids = np.concatenate([
        prompt, [config.vision_start_token_id], image, [config.vision_end_token_id], answer
    ]).astype(np.int64)  # fmt: skip
    trained = np.zeros(len(ids), dtype=bool)
    trained[len(ids) - len(answer) :] = True
    pixels = rng.standard_normal((patches, width), dtype=np.float32)
    media = MediaSample(pixels, grid, positions(ids, grid))
    return Sample(ids, trained, index, media=media)


def _video_sample(
    rng: np.random.Generator, config: Qwen2_5_VLConfig, size: tuple[int, int], temporal: int,
    positions: Qwen2VLPositions, index: int,
) -> Sample:  # fmt: skip
    """A clip conversation: prompt, ``<|vision_start|>``, one run of ``t * h * w / merge**2`` video tokens (Qwen2.5-VL's
    layout), ``<|vision_end|>``, answer; positions from the model's rule with the clip's ``second_per_grid_ts``."""
    vision = config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    grid = np.asarray([[temporal, size[0] // patch, size[1] // patch]], dtype=np.int64)
    patches = int(grid.prod())
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * patch * patch
    text_vocab = _text_vocab(config)
    prompt = rng.integers(3, text_vocab, int(rng.integers(16, 97)))
    answer = rng.integers(3, text_vocab, int(rng.integers(32, 385)))
    clip = np.full(patches // merge**2, config.video_token_id)
    ids = np.concatenate([
        prompt, [config.vision_start_token_id], clip, [config.vision_end_token_id], answer
    ]).astype(np.int64)  # fmt: skip
    trained = np.zeros(len(ids), dtype=bool)
    trained[len(ids) - len(answer) :] = True
    no_image = np.zeros((0, 3), dtype=np.int64)
    seconds = np.asarray([int(vision.temporal_patch_size) / VIDEO_FPS])
    pixels = rng.standard_normal((patches, width), dtype=np.float32)
    media = MediaSample(
        np.zeros((0, width), np.float32), no_image, positions(ids, no_image, grid, seconds), pixels, grid
    )
    return Sample(ids, trained, index, media=media)


def _text_sample(
    rng: np.random.Generator, config: Qwen3VLConfig, lengths: tuple[int, int], positions: Qwen3VLPositions,
    index: int, width: int,
) -> Sample:  # fmt: skip
    text_vocab = _text_vocab(config)
    prompt_len, answer_len = lengths
    ids = rng.integers(3, text_vocab, prompt_len + answer_len).astype(np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    trained[prompt_len:] = True
    trained[0] = False
    grid = np.zeros((0, 3), dtype=np.int64)
    media = MediaSample(np.zeros((0, width), np.float32), grid, positions(ids, grid))
    return Sample(ids, trained, index, media=media)


def packed_vlm_batches(
    count: int,
    seq_len: int,
    config: Qwen3VLConfig,
    image_fraction: float,
    sizes: Sequence[tuple[int, int]],
    seed: int,
    video_fraction: float = 0.0,
    video_temporal: int = VIDEO_TEMPORAL_PATCHES,
) -> list[dict[str, Any]]:
    """``count`` micro-batches of exactly ``seq_len`` tokens (the module docstring's data recipe), collated by
    veomni's `collate_multimodal`, plus ``doc_lens`` (list[int]), ``num_valid`` (int) and ``num_patches`` (int)."""
    rng = np.random.default_rng(seed)
    vision = config.vision_config
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    # Image positions are the same rule for Qwen2.5-VL and Qwen3-VL (t = 1); Qwen2.5-VL's tower also gets its window
    # layout from the collator, as in the trainer.
    positions = Qwen3VLPositions(int(config.image_token_id), int(vision.spatial_merge_size))
    if (
        video_fraction
    ):  # clips: the model's own rule (`veomni.models.qwen2_vl.positions`), images the same as above
        positions = Qwen2VLPositions.from_config(config)
    vision_metadata = WindowIndex.from_config(vision) if config.model_type == "qwen2_5_vl" else None
    batches, index = [], 0
    for _ in range(count):
        samples: list[Sample] = []
        used = 0
        while used < seq_len:
            draw = rng.random()
            if draw < image_fraction:
                sample = _image_sample(rng, config, sizes[int(rng.integers(len(sizes)))], positions, index)
            elif draw < image_fraction + video_fraction:
                size = sizes[int(rng.integers(len(sizes)))]
                sample = _video_sample(rng, config, size, video_temporal, positions, index)
            else:
                lengths = (int(rng.integers(32, 257)), int(rng.integers(64, 1025)))
                sample = _text_sample(rng, config, lengths, positions, index, width)
            if used + len(sample.input_ids) > seq_len:
                rest = seq_len - used
                sample = _text_sample(rng, config, (rest // 4, rest - rest // 4), positions, index, width)
            samples.append(sample)
            used += len(sample.input_ids)
            index += 1
        batch = collate_multimodal(samples, pad_id=0, vision_metadata=vision_metadata)
        batch["doc_lens"] = [len(s.input_ids) for s in samples]
        batch["num_valid"] = int((batch["labels"] != IGNORE_INDEX).sum())
        batch["images"] = sum(len(s.media.image_grid_thw) for s in samples)
        batch["videos"] = sum(len(s.media.video_grid_thw) for s in samples)
        batches.append(batch)
    return batches


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    from bench_e2e import parse_ops

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True, help="where to write the JSON results")
    add(
        "--contenders",
        default="veomni,veomni_plain,hf,hf_liger",
        help=f"comma-separated subset of {CONTENDERS}",
    )
    add("--model", choices=sorted(MODELS), default="qwen3_vl_2b", help="the architecture to train")
    add("--tiny", action="store_true", help="a tiny model of --model's family instead (CPU smoke)")
    add("--seq-len", type=int, default=8192, help="tokens per packed micro-batch row")
    add("--image-fraction", type=float, default=0.6, help="probability that a drawn sample has an image")
    add(
        "--video-fraction",
        type=float,
        default=0.0,
        help="probability that a drawn sample is a clip conversation (--model qwen2_5_vl_7b only)",
    )
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--warmup", type=int, default=3, help="untimed optimizer steps first")
    add("--steps", type=int, default=8, help="timed optimizer steps")
    add("--seed", type=int, default=0, help="weights use seed, data seed + 1")
    add("--lr", type=float, default=1e-5)
    add("--weight-decay", type=float, default=0.1)
    add("--max-grad-norm", type=float, default=1.0)
    add("--precision", choices=("bf16", "fp32"), default="bf16")
    add("--hf-master", choices=("fp32", "bf16"), default="fp32")
    add("--ac", choices=("none", "veomni", "all"), default="none")
    add("--veomni-ops", default="", help="OpsConfig overrides, e.g. attention=varlen")
    add(
        "--veomni-fsdp2",
        action="store_true",
        help="veomni/veomni_compiled through FSDP2 on a one-rank mesh instead of the trainer's one-rank default",
    )
    add(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile 2 more steps per contender into DIR/<name>.txt",
    )
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--tmpdir", default=None, help="where the initial weights are saved (default: system temp)")
    args = p.parse_args(argv)
    args.contenders = [c for c in filter(None, args.contenders.split(","))]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown or not args.contenders:
        p.error(f"--contenders: unknown {unknown} (choose from {CONTENDERS})" if unknown else "--contenders is empty")  # fmt: skip
    if not 0.0 <= args.image_fraction <= 1.0:
        p.error(f"--image-fraction must be in [0, 1], got {args.image_fraction}")
    if not 0.0 <= args.video_fraction <= 1.0 - args.image_fraction:
        p.error(f"--video-fraction must be in [0, 1 - --image-fraction], got {args.video_fraction}")
    if args.video_fraction and args.model != "qwen2_5_vl_7b":
        p.error(
            f"--video-fraction: clips are laid out for --model qwen2_5_vl_7b only, got --model {args.model}"
        )
    for flag in ("seq_len", "grad_accum", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.seq_len < 2048 and not args.tiny:
        p.error(f"--seq-len {args.seq_len} is below the largest image conversation (~1100 tokens) plus text")
    try:
        args.veomni_ops = parse_ops(args.veomni_ops)
    except ValueError as err:
        p.error(f"--veomni-ops: {err}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write ``--out`` and print a table; returns the JSON object."""
    args = parse_args(argv)
    created_group = not dist.is_initialized()
    device = setup_distributed(args.device)
    try:
        if dist.get_world_size() != 1:
            raise SystemExit(f"bench_vlm runs in one process; the world size is {dist.get_world_size()}")
        return _run(args, device)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = vlm_config(args.tiny, args.model)
    with torch.device("meta"):
        probe = AutoModelForImageTextToText.from_config(config)
    task = VlmTask.for_model(probe)
    del probe
    n_steps = args.warmup + args.steps
    sizes = TINY_IMAGE_SIZES if args.tiny else IMAGE_SIZES
    temporal = TINY_VIDEO_TEMPORAL_PATCHES if args.tiny else VIDEO_TEMPORAL_PATCHES
    if args.video_fraction:  # a clip conversation longer than a row would never be drawn
        unit = (config.vision_config.patch_size * config.vision_config.spatial_merge_size) ** 2
        longest = max(h * w for h, w in sizes) // unit * temporal + 96 + 384 + 2
        if longest > args.seq_len:
            raise SystemExit(
                f"--seq-len {args.seq_len} is below the longest clip conversation ({longest} tokens)"
            )
    cpu_batches = packed_vlm_batches(
        n_steps * args.grad_accum, args.seq_len, config, args.image_fraction, sizes, args.seed + 1,
        args.video_fraction, temporal,
    )  # fmt: skip
    batches = [_to(b, device) for b in cpu_batches]
    steps = [batches[i * args.grad_accum : (i + 1) * args.grad_accum] for i in range(n_steps)]
    flops = [
        sum(task.flops_per_token * b["input_ids"].numel()
            + attention_flops(b["doc_lens"], task.num_layers, task.query_width)
            + task.vision_flops_per_patch * b["num_patches"] for b in mb)
        for mb in steps
    ]  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_vlm_", dir=args.tmpdir) as weights:
        save_initial_weights(config, weights, args.seed, device)
        settings = Settings(
            device=device, weights=weights, lr=args.lr, weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm, precision=args.precision, ac=args.ac, hf_master=args.hf_master,
            veomni_ops=args.veomni_ops, veomni_fsdp2=args.veomni_fsdp2, profile_dir=args.profile,
            task="image_text_to_text",
        )  # fmt: skip
        for name in CONTENDERS:  # the fixed order: Liger's global patches must come last
            if name not in args.contenders:
                continue
            problem = _liger_problem(device) if name == "hf_liger" else None
            if problem:
                results[name] = {"skipped": problem}
                continue
            print(f"[bench_vlm] {name} ...", file=sys.stderr, flush=True)
            try:
                results[name] = run_contender(name, settings, steps, args.warmup, flops)
            except Exception as err:  # noqa: BLE001 - a failing contender (OOM, say) is a result to report
                traceback.print_exc()
                results[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
                _free(device)
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "model": f"tiny {args.model} (smoke)" if args.tiny else MODELS[args.model][3],
        "config": MODELS[args.model][2 if args.tiny else 1],
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "data": {
            "tokens_per_step": args.seq_len * args.grad_accum,
            "image_sizes": sizes,
            "samples_per_micro_batch": [len(b["doc_lens"]) for b in cpu_batches],
            "images_per_micro_batch": [b["images"] for b in cpu_batches],
            "videos_per_micro_batch": [b["videos"] for b in cpu_batches],
            "patches_per_micro_batch": [b["num_patches"] for b in cpu_batches],
            "valid_labels_per_step": [sum(b["num_valid"] for b in mb) for mb in steps],
        },
        "mfu": {
            "formula": "(lm_flops_per_token * tokens + causal attention per sample + vision_flops_per_patch * "
            "patches) / (seconds * peak_flops); veomni.train.tasks.VlmTask, recompute not counted",
            "lm_flops_per_token": task.flops_per_token,
            "vision_flops_per_patch": task.vision_flops_per_patch,
            "peak_flops": peak_flops(device),
        },  # fmt: skip
        "contenders": results,
        "ratios": _ratios(results),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, r in results.items():
        if "tokens_per_s_per_gpu" in r:
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
            mem = f"{r['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in r else ""
            print(
                f"{name:24s} {r['tokens_per_s_per_gpu']:10.0f} tok/s  MFU {mfu}  {mem}  loss {r['final_loss']:.4f}"
            )
        else:
            print(f"{name:24s} {r}")
    for pair, ratio in result["ratios"].items():
        print(f"{pair:36s} " + "  ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    return result


if __name__ == "__main__":
    main()
