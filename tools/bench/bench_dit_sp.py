"""Ulysses SP scaling of a Wan DiT (issue 18): one model trained at SP = P, P/2, ..., 1 on the same world, JSON out.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 tools/bench/bench_dit_sp.py --out dit_sp.json
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench/bench_dit_sp.py --out s.json \\
        --size tiny --device cpu --sp 2,1 --steps 1 --warmup 1 --precision fp32     # CPU smoke

Model: ``--size i2v_14b`` is Wan2.1-I2V-14B-480P's transformer config (40 blocks, 40 heads of 128, image
cross-attention), ``t2v_1_3b`` Wan2.1-T2V-1.3B's, RANDOMLY INITIALISED (a throughput benchmark). Built per SP
degree by `veomni.models.build.build_model` as the trainer builds a DiT: FSDP2 per block over all ranks
(dp_shard = world / sp; bf16 compute over fp32 masters, fp32 reduce), activation checkpointing, the device's
``OpsConfig`` defaults (veomni's RMSNorm / rotary / attention kernels bound to Wan, `veomni.models.wan.kernels`),
Ulysses SP (`veomni.models.wan.sp`) for sp > 1. Optimizer: `veomni.train.optim.build_adamw`; clipping:
`veomni.core.clip.clip_grad_norm`; loss: `veomni.train.tasks.dit.DitTask`'s per-sample MSE divided by the SP
degree (each SP rank computes the whole gathered loss).

Data: per step each SP group trains one 480x832, 81-frame sample (latents ``[C, 21, 60, 104]``: 32,760 tokens),
prompt embeddings ``[512, 4096]`` and, for I2V, CLIP image features ``[257, 1280]``; N(0, 1) values seeded by
(seed, step, dp rank) -- the speed of a step does not depend on the values.

Reported per SP degree: samples/s over the world, tokens/s per GPU, MFU (`DitFlops`, recomputation not
counted, over the device's peak), peak allocated/reserved memory (max over ranks), median step seconds, losses.
A configuration that fails (out of memory, say) is recorded as ``{"error": ...}`` and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from veomni.core.clip import clip_grad_norm
from veomni.core.fsdp import FSDPPolicy
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.diffusers.build import dit_ops
from veomni.models.wan.rules import weight_counts as wan_weight_counts
from veomni.train.loop import setup_distributed
from veomni.train.metrics import peak_flops
from veomni.train.optim import build_adamw
from veomni.train.tasks.dit import DitFlops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers live beside this
from bench_common import max_over_ranks, release, sync  # noqa: E402
from dit_contenders import WAN_T2V_1_3B  # noqa: E402

GIB = 2**30
# Wan2.1-I2V-14B-480P-Diffusers transformer/config.json (its __init__ arguments); T2V-1.3B's is dit_contenders'.
WAN_I2V_14B: dict[str, Any] = {
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 36,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": 1280,
    "added_kv_proj_dim": 5120, "rope_max_seq_len": 1024,
}  # fmt: skip
TINY: dict[str, Any] = WAN_I2V_14B | {
    "num_attention_heads": 4, "attention_head_dim": 12, "in_channels": 12, "out_channels": 4, "text_dim": 32,
    "freq_dim": 16, "ffn_dim": 40, "num_layers": 2, "image_dim": 24, "added_kv_proj_dim": 48,
}  # fmt: skip
# config, latent [F, H, W] of one sample, prompt length, image tokens (0: T2V)
SIZES: dict[str, tuple[dict[str, Any], tuple[int, int, int], int, int]] = {
    "i2v_14b": (WAN_I2V_14B, (21, 60, 104), 512, 257),
    "t2v_1_3b": (WAN_T2V_1_3B, (21, 60, 104), 512, 0),
    "tiny": (TINY, (3, 6, 10), 512, 5),  # Wan's I2V attention splits the context at 512 text tokens
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True, help="where rank 0 writes the JSON (rewritten after every configuration)")
    add("--size", choices=tuple(SIZES), default="i2v_14b")
    add(
        "--sp", default=None, help="comma-separated SP degrees in run order (default: world, world/2, ..., 1)"
    )
    add("--steps", type=int, default=2, help="timed optimizer steps per configuration")
    add("--warmup", type=int, default=1, help="untimed optimizer steps first")
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16: bf16 compute over fp32 masters, fp32 reduce; fp32: no mixed precision")  # fmt: skip
    add("--latent", default=None,
        help="latent frames,height,width of a sample (default: the size's 480x832, 81 frames = 21,60,104; "
             "720x1280, 81 frames = 21,90,160)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.latent is None:
        args.latent = SIZES[args.size][1]
    else:
        try:
            args.latent = tuple(int(x) for x in args.latent.split(","))
        except ValueError:
            args.latent = ()
        if len(args.latent) != 3 or min(args.latent) < 1:
            p.error(f"--latent: expected three positive integers F,H,W, got {args.latent!r}")
    return args


def sp_degrees(text: str | None, world: int) -> list[int]:
    """``--sp`` as a list; each degree must divide the world size."""
    if text is None:
        degrees, sp = [], world
        while sp >= 1:
            degrees.append(sp)
            sp //= 2
        return degrees
    degrees = [int(x) for x in text.split(",") if x.strip()]
    bad = [d for d in degrees if d < 1 or world % d]
    if bad or not degrees:
        raise ValueError(f"--sp: every degree must divide the world size {world}, got {text!r}")
    return degrees


def make_inputs(args: argparse.Namespace, step: int, dp_rank: int, device: torch.device) -> dict[str, Any]:
    """One sample's transformer inputs and target (module docstring), the same on every rank of an SP group."""
    config, _, text_len, image_len = SIZES[args.size]
    frames, height, width = args.latent
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_rank)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    shape = (1, config["in_channels"], frames, height, width)
    out = {
        "hidden_states": torch.randn(shape, generator=g).to(device, dtype),
        "timestep": torch.randint(0, 1000, (1,), generator=g).float().to(device),
        "encoder_hidden_states": torch.randn(1, text_len, config["text_dim"], generator=g).to(device, dtype),
        "target": torch.randn(1, config["out_channels"], frames, height, width, generator=g).to(device),
    }
    if image_len:
        out["encoder_hidden_states_image"] = torch.randn(1, image_len, config["image_dim"], generator=g).to(
            device, dtype
        )
    return out


def tokens_per_sample(size: str, latent: tuple[int, int, int]) -> int:
    frames, height, width = latent
    pt, ph, pw = SIZES[size][0]["patch_size"]
    return (frames // pt) * (height // ph) * (width // pw)


def write_config(size: str, directory: str) -> str:
    """A diffusers ``config.json`` for the size (what `build_model` reads as a DiT config); returns the dir."""
    import diffusers

    values = SIZES[size][0] | {
        "_class_name": "WanTransformer3DModel",
        "_diffusers_version": diffusers.__version__,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(values, f)
    return directory


def run_config(args: argparse.Namespace, sp: int, config_dir: str, device: torch.device) -> dict[str, Any]:
    """Build at SP ``sp``, warm up, time ``args.steps`` steps; the configuration's JSON record."""
    world = dist.get_world_size()
    state = build_parallel_state(ParallelDims(dp_shard=world // sp, sp=sp), device.type)
    ops = OpsConfig()  # the device's defaults, as the trainer's dit setup binds them
    torch.manual_seed(args.seed)
    mixed = args.precision == "bf16"
    policy = FSDPPolicy(
        block_patterns=("blocks.*",), param_dtype=torch.bfloat16 if mixed else None,
        reduce_dtype=torch.float32, activation_checkpointing=True,
    )  # fmt: skip
    t0 = time.perf_counter()
    model = build_model(
        config_dir, parallel_state=state, dtype=torch.float32, fsdp_policy=policy, ops=ops,
        task="diffusion_transformer",
    )  # fmt: skip
    build_s = time.perf_counter() - t0
    model.train()
    optimizer = build_adamw(model, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    dp_rank = state.dp_rank
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        batch = make_inputs(args, step, dp_rank, device)
        target = batch.pop("target")
        sync(device)
        start = time.perf_counter()
        with use_parallel_state(state):
            sample = model(**batch, return_dict=False)[0]
            loss = (sample.float() - target).pow(2).flatten(1).mean(dim=1).sum() / sp
            loss.backward()
            clip_grad_norm(model, 1.0, state)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()) * sp)
        _say(f"sp{sp} step {step + 1}/{args.warmup + args.steps}: {time.perf_counter() - start:.3f} s")
    step_s = statistics.median(times)
    times_max = max_over_ranks([step_s], device)[0]
    samples_per_step = world // sp
    tokens = tokens_per_sample(args.size, args.latent)
    config, _, text_len, image_len = SIZES[args.size]
    with torch.device("meta"):
        from diffusers import WanTransformer3DModel

        flops = DitFlops.from_counts(
            wan_weight_counts(WanTransformer3DModel(**config)), text_len, image_len
        ).sample(tokens)
    peak = peak_flops(device) if device.type == "cuda" else None
    mem = max_over_ranks(
        [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB]
        if device.type == "cuda" else [0.0, 0.0],
        device,
    )  # fmt: skip
    record = {
        "sp": sp, "dp": world // sp, "build_s": build_s, "step_s": times_max,
        "samples_per_s": samples_per_step / times_max,
        "tokens_per_s_per_gpu": samples_per_step * tokens / times_max / world,
        "mfu": (samples_per_step * flops / times_max / world / peak) if peak else None,
        "peak_alloc_gib": mem[0], "peak_reserved_gib": mem[1], "losses": losses,
        "attention": dit_ops(ops).attention, "wan_ops": {k: getattr(ops, k) for k in ("rms_norm", "rope")},
    }  # fmt: skip
    del model, optimizer
    _free_and_reset(device)
    return record


def _free_and_reset(device: torch.device) -> None:
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # each SP degree's peak on its own


def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(f"[bench_dit_sp] {line}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every SP degree, write ``--out`` (rank 0) and return the JSON object."""
    args = parse_args(argv)
    created_group = not dist.is_initialized()
    device = setup_distributed(args.device)
    try:
        return _run(args, device)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    world = dist.get_world_size()
    degrees = sp_degrees(args.sp, world)
    result: dict[str, Any] = {
        "benchmark": "bench_dit_sp (issue 18: Wan DiT Ulysses SP scaling)", "argv": list(sys.argv),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world, "size": args.size, "latent": list(args.latent), "config": SIZES[args.size][0],
        "tokens_per_sample": tokens_per_sample(args.size, args.latent), "precision": args.precision, "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        shared = [write_config(args.size, tmp) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)  # one host: rank 0's directory serves every rank
        for sp in degrees:
            _say(f"sp{sp}: start")
            try:
                record = run_config(args, sp, shared[0], device)
            except Exception as err:  # noqa: BLE001 -- recorded, then the next configuration runs
                record = {"sp": sp, "error": f"{type(err).__name__}: {err}"}
                _say(traceback.format_exc())
                _free_and_reset(device)
            result["runs"].append(record)
            if dist.get_rank() == 0:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
            _say(json.dumps({k: v for k, v in record.items() if k != "losses"}))
        dist.barrier()  # rank 0's config directory outlives every rank's build
    return result


if __name__ == "__main__":
    main()
