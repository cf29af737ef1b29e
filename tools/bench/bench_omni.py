"""Omni thinker training steps: veomni's Qwen2.5-Omni thinker against plain transformers on one mixed
audio / image / text batch, side by side in one process, JSON out.

    python3 tools/bench/bench_omni.py --out omni.json                       # Qwen2.5-Omni-7B-class thinker, 1 GPU
    python3 tools/bench/bench_omni.py --out smoke.json --tiny --steps 2 --warmup 1   # CPU smoke

Model: Qwen2.5-Omni-7B's published thinker architecture (``Qwen2_5OmniThinkerConfig()`` defaults with the ViT width
of the release: a 32-layer Whisper-style audio tower of width 1280, a 32-block windowed ViT of width 1280, a 28-layer
Qwen2.5-7B text model; 8.9B parameters; nothing downloaded), initialised once by plain transformers (seeded),
saved, and loaded by both contenders. Memory: bf16 parameters + gradients + bf16 AdamW states are 8 bytes per
parameter, ~71 GB before activations: run it on an H200 (an 80 GB H100 is expected to run out of memory).

Data (seeded, identical for both): ``--rows`` rows, each ``--seq-len`` tokens: a row holds one audio clip of
``--audio-seconds`` s (its ``seconds * 100`` mel frames -> ``seconds * 25`` audio tokens), one image of
``--image-side`` x ``--image-side`` patches (``side**2 / 4`` tokens) and text; labels are the text tokens. Mel
features and pixel rows are seeded noise (the timing does not depend on their values). ``--video-frames N`` adds a
video of N frames (``N / 2`` temporal patches of ``--video-side``**2 patches, sampled at 2 fps); with
``--audio-in-video`` the row's clip is that video's audio track, interleaved with its frames per 2 s chunk
(`veomni.models.qwen2_5_omni.video.video_placeholder_ids`, the processor's layout), instead of a standalone clip.

    python3 tools/bench/bench_omni.py --out omni_video.json --video-frames 16 --audio-in-video   # video + its audio

Contenders: ``veomni`` (`build_model` with the default OpsConfig: veomni attention, fused linear cross-entropy,
compiled blocks) and ``hf`` (transformers' class, SDPA). Each gets the batch its own trainer would hand the model:
HF's processor output (the model derives mrope positions and the towers' segment tables on the device), and for
veomni also what its collator computes on the host in the data-loader workers (the row's mrope ``position_ids``,
the ViT window tables ``vision_metadata``, the audio chunk tables ``audio_metadata``), so its forward reads nothing
back from the device but the placeholder counts; ``--veomni-inputs processor`` gives veomni HF's batch instead. Both train bf16 parameters with AdamW (fp32 would not fit a 7B thinker's optimizer
state on one 80 GB GPU without sharding; ``--optimizer fused`` by default on CUDA, as both trainers use); the step is forward + backward + optimizer step. ``--rounds N`` runs the contender list N times (ratios
from each contender's fastest round: the host-bound HF step varied 676-831 ms from run to run on one machine). Reported: median step
time, tokens/s, peak memory, and the first step's loss of each (they must agree to bf16 tolerance). ``--loss-read
end`` (default) reads the losses back after the timed steps, as veomni's trainer does once per log window, so one
step's host work overlaps the previous step's GPU tail; ``step`` reads each step's loss (a host sync per step for
both contenders, the protocol of the notebook's entries before 2026-11-28, fourth session).
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
from transformers import Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniThinkerForConditionalGeneration as Upstream,
)

from veomni.core import FSDPPolicy
from veomni.kernels import OpsConfig
from veomni.models.build import build_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    environment,
    error_text,
    host_sync_sites,
    mark,
    median_ms,
    profile_calls,
    release,
    write_json,
)
from bench_e2e import parse_ops  # noqa: E402


def thinker_config(tiny: bool) -> Qwen2_5OmniThinkerConfig:
    """The 7B thinker (transformers' defaults are Qwen2.5-Omni-7B's), or a CPU-sized one for smoke runs."""
    if not tiny:
        # transformers' defaults are the release's except the ViT width (its default 3584 is the LM's; the
        # released Qwen2.5-Omni-7B ViT is 1280 wide with 16 heads).
        # The vision start/end ids are not thinker-config fields in transformers 5.23 (the released config.json
        # carries them); the values are the released tokenizer's.
        return Qwen2_5OmniThinkerConfig(
            vision_config={"hidden_size": 1280, "num_heads": 16},
            vision_start_token_id=151652,
            vision_end_token_id=151653,
        )
    return Qwen2_5OmniThinkerConfig(
        text_config={"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}},
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 2, "out_hidden_size": 128,
                       "fullatt_block_indexes": [1]},
        audio_config={"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 96,
                      "d_model": 64, "output_dim": 128},
        audio_token_index=1000, image_token_index=1001, video_token_index=1002, audio_start_token_id=1003,
        audio_end_token_id=1004, vision_start_token_id=1005, vision_end_token_id=1006,
    )  # fmt: skip


def mixed_batch(config: Qwen2_5OmniThinkerConfig, args: argparse.Namespace, device: torch.device) -> dict:
    """Rows of ``seq_len`` tokens, each: text, one audio clip, text, one image, text (module docstring)."""
    gen = torch.Generator().manual_seed(args.seed)
    frames = int(args.audio_seconds * 100)
    audio_tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    side = args.image_side
    image_tokens = side * side // 4
    text_vocab = min(config.audio_token_id, config.image_token_id, config.vision_start_token_id) - 1
    fixed = 4 + audio_tokens + image_tokens
    vc = config.vision_config
    video = _video_tokens(config, args, audio_tokens)
    if video is not None:
        fixed += 2 + len(video) - (audio_tokens + 2 if args.audio_in_video else 0)
    if fixed + 8 > args.seq_len:
        raise SystemExit(
            f"--seq-len {args.seq_len} cannot hold the row's {fixed} audio, image and video tokens"
        )
    rows = []
    for _ in range(args.rows):
        text = torch.randint(0, text_vocab, (args.seq_len - fixed,), generator=gen)
        third = text.shape[0] // 3
        audio = [torch.tensor([config.audio_start_token_id]), torch.full((audio_tokens,), config.audio_token_id),
                 torch.tensor([config.audio_end_token_id])]  # fmt: skip
        if video is not None:
            clip = [
                torch.tensor([config.vision_start_token_id]),
                video,
                torch.tensor([config.vision_end_token_id]),
            ]
            audio = clip if args.audio_in_video else audio + clip
        rows.append(torch.cat([
            text[:third], *audio, text[third:2 * third], torch.tensor([config.vision_start_token_id]),
            torch.full((image_tokens,), config.image_token_id), torch.tensor([config.vision_end_token_id]),
            text[2 * third:],
        ]))  # fmt: skip
    input_ids = torch.stack(rows)
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.masked_fill(input_ids >= text_vocab, -100),
        "input_features": torch.randn(args.rows, config.audio_config.num_mel_bins, frames, generator=gen),
        "feature_attention_mask": torch.ones(args.rows, frames, dtype=torch.long),
        "pixel_values": torch.randn(args.rows * side * side, width, generator=gen),
        "image_grid_thw": torch.tensor([[1, side, side]] * args.rows),
    }
    if video is not None:
        grid = [args.video_frames // vc.temporal_patch_size, args.video_side, args.video_side]
        batch["pixel_values_videos"] = torch.randn(
            args.rows * grid[0] * grid[1] * grid[2], width, generator=gen
        )
        batch["video_grid_thw"] = torch.tensor([grid] * args.rows)
        batch["video_second_per_grid"] = torch.full((args.rows,), vc.temporal_patch_size / 2.0)
    out = {k: v.to(device) for k, v in batch.items()}
    out["use_audio_in_video"] = bool(args.audio_in_video)
    return out


def _video_tokens(config: Qwen2_5OmniThinkerConfig, args: argparse.Namespace, audio_tokens: int) -> Any:
    """The video placeholder run of one row (None without ``--video-frames``): 2 fps, so 1 s per grid step."""
    from veomni.models.qwen2_5_omni.video import VideoTokens, video_placeholder_ids

    if not args.video_frames:
        if args.audio_in_video:
            raise SystemExit("--audio-in-video needs --video-frames")
        return None
    vc = config.vision_config
    if args.video_frames % vc.temporal_patch_size or args.video_side % vc.spatial_merge_size:
        raise SystemExit(
            f"--video-frames must be a multiple of {vc.temporal_patch_size} and --video-side of "
            f"{vc.spatial_merge_size}"
        )
    tokens = VideoTokens(config.video_token_id, config.audio_token_id, config.audio_start_token_id,
                         config.audio_end_token_id)  # fmt: skip
    grid = (args.video_frames // vc.temporal_patch_size, args.video_side, args.video_side)
    ids = video_placeholder_ids(
        grid, vc.spatial_merge_size, tokens, vc.temporal_patch_size / 2.0,
        audio_tokens=audio_tokens if args.audio_in_video else None,
        position_id_per_seconds=config.position_id_per_seconds, seconds_per_chunk=config.seconds_per_chunk,
    )  # fmt: skip
    return torch.as_tensor(ids)


def trainer_inputs(model: torch.nn.Module, batch: dict, config: Qwen2_5OmniThinkerConfig) -> dict:
    """``batch`` plus what veomni's omni collator computes on the host (module docstring), on the batch's device.
    Host work, as in the data-loader workers: not part of the timed step."""
    from veomni.models.qwen2_5_omni.audio_layout import AudioChunks
    from veomni.models.qwen2_5_omni.positions import Qwen2_5OmniPositions

    device = batch["input_ids"].device
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    rows = cpu["input_ids"].shape[0]
    frames = cpu["feature_attention_mask"].sum(-1)
    positions = Qwen2_5OmniPositions(config, use_audio_in_video=bool(batch["use_audio_in_video"]))
    video = cpu.get("video_grid_thw")
    seconds = cpu.get("video_second_per_grid")
    position_ids = torch.stack([
        torch.as_tensor(positions(
            cpu["input_ids"][r].numpy(), image_grid_thw=cpu["image_grid_thw"][r : r + 1].numpy(),
            video_grid_thw=None if video is None else video[r : r + 1].numpy(),
            audio_frames=frames[r : r + 1].numpy(),
            second_per_grids=None if seconds is None else seconds[r : r + 1].numpy(),
        )) for r in range(rows)
    ], dim=1)  # fmt: skip
    grids = torch.cat([g for g in (cpu["image_grid_thw"], video) if g is not None])
    tables = {
        "vision_metadata": model.vision_collate_metadata()(grids),
        "audio_metadata": AudioChunks.from_config(config.audio_config)(
            frames.tolist(), cpu["input_features"].shape[2]
        ),
    }
    moved = {
        name: {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in table.items()}
        for name, table in tables.items()
    }
    return {**batch, **moved, "attention_mask": None, "position_ids": position_ids.to(device)}


# veomni contenders by how the towers' blocks run when blocks are compiled (``ops.compile`` on / auto on CUDA):
# ``blocks`` = every block compiled on its own (build_model's default: 28 text + 32 ViT + 32 audio regions),
# ``eager`` = the text blocks only, ``region`` = the text blocks, plus each tower's whole forward as one region,
# ``graphs`` = as ``region``, the towers' graphs under CUDA graphs (``mode="reduce-overhead"``).
TOWER_VARIANTS = {
    "veomni": "blocks", "veomni_towers_eager": "eager", "veomni_towers_region": "region",
    "veomni_towers_graphs": "graphs", "veomni_cppwrap": "blocks",
}  # fmt: skip
# Inductor config a contender's compiles run under: ``cpp_wrapper`` replaces each compiled graph's Python wrapper
# (kernel launches, allocations, size arithmetic in Python per call) with compiled C++, the host time per graph
# call that the towers' small blocks are bound by.
INDUCTOR_CONFIG = {"veomni_cppwrap": {"cpp_wrapper": True}}
TEXT_BLOCKS = "model.language_model.layers.*"


def tower_marks(model: torch.nn.Module) -> list[Any]:
    """Hooks marking the towers' phases for `idle_by_phase`: each tower's forward (and the text model after it),
    and its backward from the moment the gradient of its output arrives. Returns the handles to remove."""
    holder = getattr(
        model, "model", model
    )  # veomni's thinker holds the towers one level down, HF's on itself
    hooks = []
    for label, tower in (("audio", holder.audio_tower), ("vision", holder.visual)):

        def after(module: Any, inputs: Any, output: Any, label: str = label) -> None:
            mark("forward: text")
            hidden = output if torch.is_tensor(output) else output[0]
            if hidden.requires_grad:
                hidden.register_hook(lambda grad, label=label: mark(f"backward: {label} tower"))

        hooks.append(
            tower.register_forward_pre_hook(lambda m, a, label=label: mark(f"forward: {label} tower"))
        )
        hooks.append(tower.register_forward_hook(after))
    return hooks


def run_contender(name: str, path: str, batch: dict, args: argparse.Namespace, device: torch.device) -> dict:
    import torch._inductor.config as inductor_config

    # Compiles are lazy (first steps): the whole contender runs under its config.
    with inductor_config.patch(INDUCTOR_CONFIG.get(name, {})):
        return _run_contender(name, path, batch, args, device)


def _run_contender(name: str, path: str, batch: dict, args: argparse.Namespace, device: torch.device) -> dict:
    if name.startswith("veomni"):
        chosen = dict(args.veomni_ops)
        if device.type != "cuda":
            chosen.setdefault("attention", "sdpa")
        ops = OpsConfig(**chosen)
        towers = TOWER_VARIANTS[name]
        # Only the block patterns matter without a parallel_state: they choose what build_model compiles.
        policy = None if towers == "blocks" else FSDPPolicy(block_patterns=(TEXT_BLOCKS,), param_dtype=None)
        model = build_model(
            path, weights=path, ops=ops, dtype=torch.bfloat16, device=device, task="any_to_any",
            fsdp_policy=policy,
        )  # fmt: skip
        if towers in ("region", "graphs") and ops.compile_enabled:
            mode = "reduce-overhead" if towers == "graphs" else None
            for tower in (model.model.audio_tower, model.model.visual):
                # One dynamo region per tower (graph breaks allowed: the towers' host-side table handling);
                # "graphs": its graphs replayed as CUDA graphs (inductor's cudagraph trees; static shapes here).
                tower.forward = torch.compile(tower.forward, mode=mode)
        if args.veomni_inputs == "trainer":
            batch = trainer_inputs(model, batch, model.config)
    else:
        model = Upstream.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    model.train()
    # fused: what veomni's trainer and HF's Trainer (optim="adamw_torch_fused") both step with on CUDA.
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.optimizer == "fused")
    losses: list[torch.Tensor] = []
    marking = False  # profiled pass only: phase marks for bench_common.idle_by_phase

    def step() -> None:
        if marking:
            mark("forward")
        loss = model(**batch, use_cache=False).loss  # training: no KV cache (as the trainer)
        if marking:
            mark("backward: text")
        loss.backward()
        if marking:
            mark("optimizer")
        optim.step()
        optim.zero_grad(set_to_none=True)
        if marking:
            mark("after step")
        losses.append(loss.detach())
        if args.loss_read == "step":
            float(losses[-1])  # a host sync per step, as a loop that logs every step's loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(step, device, args.warmup, args.steps)
    tokens = batch["input_ids"].numel()
    row = {
        "contender": name,
        "median_step_ms": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "first_loss": float(losses[0]),
    }
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.profile_dir:
        out = os.path.join(args.profile_dir, f"omni_{name}.txt")
        hooks = tower_marks(model)
        marking = True
        row.update(profile_calls(step, device, out) or {})
        marking = False
        for hook in hooks:
            hook.remove()
        row.update(host_sync_sites(step, device) or {})
    # The caller's release() frees the model once this frame (the closure's only owner) is gone.
    return row


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized thinker (smoke test)")
    p.add_argument(
        "--contenders", default="veomni,hf", help=f"comma list of hf and {', '.join(TOWER_VARIANTS)}"
    )
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--audio-seconds", type=float, default=10.0)
    p.add_argument("--image-side", type=int, default=32, help="patches per side (32: 448x448 px, 256 tokens)")
    p.add_argument("--video-frames", type=int, default=0, help="frames of one video per row (0: no video)")
    p.add_argument("--video-side", type=int, default=16, help="video patches per side (16: 224x224 px)")
    p.add_argument("--audio-in-video", action="store_true", help="the row's clip is its video's audio track")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the contender list this many times; ratios use each one's fastest",
    )
    p.add_argument(
        "--optimizer", choices=("fused", "foreach"), default="fused", help="torch AdamW implementation"
    )
    p.add_argument(
        "--veomni-ops", default="", help="OpsConfig overrides for veomni, e.g. compile=off,attention=sdpa"
    )
    p.add_argument(
        "--veomni-inputs",
        choices=("trainer", "processor"),
        default="trainer",
        help="veomni's batch: with its collator's host tables (trainer) or HF's batch (processor)",
    )
    p.add_argument(
        "--loss-read",
        choices=("end", "step"),
        default="end",
        help="read the losses back after the timed steps (veomni's trainer: once per log window) or every step "
        "(HF's Trainer with its default logging_nan_inf_filter tests each step's loss on the host)",
    )
    p.add_argument("--profile-dir", default=None, help="profile one more step per contender: top ops to DIR/")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    unknown = sorted(set(args.contenders.split(",")) - {"hf", *TOWER_VARIANTS})
    if unknown:
        p.error(f"--contenders: unknown {unknown} (choose from hf, {', '.join(TOWER_VARIANTS)})")
    try:
        args.veomni_ops = parse_ops(args.veomni_ops)
    except ValueError as err:
        p.error(str(err))
    if args.optimizer == "fused" and not torch.cuda.is_available():
        args.optimizer = "foreach"  # fused AdamW is a CUDA kernel
    if args.tiny and args.seq_len == 4096:
        args.seq_len, args.audio_seconds, args.image_side = 256, 1.0, 8
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = thinker_config(args.tiny)
    result: dict[str, Any] = {
        "bench": "omni_thinker_step",
        "args": vars(args),
        "env": environment(device),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(args.seed)
        Upstream(config).to(torch.bfloat16).save_pretrained(path)
        batch = mixed_batch(config, args, device)
        result["tokens_per_step"] = batch["input_ids"].numel()
        for round_ in range(args.rounds):
            for name in args.contenders.split(","):
                try:
                    row = run_contender(name, path, batch, args, device)
                except Exception as err:  # one contender failing must not lose the others' numbers
                    traceback.print_exc()
                    row = {"contender": name, "error": error_text(err)}
                release(device)
                result["rows"].append({**row, "round": round_})
                write_json(args.out, result)  # after every contender: a time-out keeps what finished
    # Each contender's fastest round: the host-bound HF step moved 676 -> 831 ms between two processes on one machine
    # (notebook/benchmarks-log.md 2026-11-28), so one round per contender measures host noise as much as code.
    by_name: dict[str, dict] = {}
    for r in (r for r in result["rows"] if "error" not in r):
        best = by_name.get(r["contender"])
        if best is None or r["median_step_ms"] < best["median_step_ms"]:
            by_name[r["contender"]] = r
    result["best"] = {name: row["median_step_ms"] for name, row in by_name.items()}
    if "hf" in by_name:
        result["speedups_vs_hf"] = {
            name: row["tokens_per_s"] / by_name["hf"]["tokens_per_s"]
            for name, row in by_name.items() if name in TOWER_VARIANTS
        }  # fmt: skip
        if "veomni" in by_name:
            result["speedup_vs_hf"] = result["speedups_vs_hf"]["veomni"]
    write_json(args.out, result)
    print(result)
    return result


if __name__ == "__main__":
    main()
