"""Write the DiT quickstart assets of veomni-train: synthetic clips of moving coloured shapes with captions, a tiny
Wan2.1-shaped transformer config and the configs (no weights) of tiny Wan condition models.

Usage: ``uv run python tools/make_quickstart_dit_data.py [--out DIR]`` (default: the package's
``veomni/train/assets/quickstart_dit``). The output is a pure function of this file: the clips are drawn with
integer geometry from a seeded ``random.Random``, the configs are written by diffusers / transformers themselves,
and the VAE's latent statistics are measured on the clips with the condition models the quickstart recipe builds
(``dit.condition_init: random``, ``train.seed: 0``). tests/train/test_dit_train.py checks that a fresh run
reproduces the committed files (PNG pixels, every other file byte for byte).

What is written:
    train.jsonl        ``{"video": "clips/NNN", "caption": ...}`` (5 frames of 32x32 or 32x48) and
                       ``{"image": "clips/NNN/000.png", "caption": ...}`` rows; paths relative to the file.
    clips/NNN/*.png    the frames: one shape (circle, square, diamond) of one colour moving across a dark
                       background by a fixed step per frame ("a red circle moving right").
    transformer/       ``config.json`` of a tiny ``WanTransformer3DModel`` (diffusers ``save_config``).
    condition/         a Wan pipeline directory without weights: ``model_index.json``, ``tokenizer/`` (a
                       word-level Unigram tokenizer with T5's conventions), ``text_encoder/config.json`` (UMT5),
                       ``vae/config.json`` (``AutoencoderKLWan``, latents_mean/std measured here),
                       ``scheduler/scheduler_config.json`` (flow matching, shift 3).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "packages/veomni-train/src/veomni/train/assets/quickstart_dit"
SEED = 20260822
FRAMES = 5
SIZES = [(32, 32)] * 4 + [(32, 48)]  # (H, W); one clip in five is wide: a second shape bucket
N_CLIPS, N_IMAGES = 40, 8
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (235, 215, 40),
           "white": (240, 240, 240)}  # fmt: skip
SHAPES = ("circle", "square", "diamond")
MOTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}
STEP = 4  # pixels per frame
RADIUS = 6
BACKGROUND = (16, 16, 24)
WORDS = ["a", "moving", "still", *COLOURS, *SHAPES, *MOTIONS]
MAX_SEQUENCE_LENGTH = 16
TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
    text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=32,
)  # fmt: skip
VAE = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
)
UMT5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, dropout_rate=0.0)  # fmt: skip
TRAIN_SEED = 0  # the recipe's train.seed: the random condition models the latent statistics are measured with


def _inside(shape: str, dx: int, dy: int) -> bool:
    if shape == "circle":
        return dx * dx + dy * dy <= RADIUS * RADIUS
    if shape == "square":
        return abs(dx) <= RADIUS - 1 and abs(dy) <= RADIUS - 1
    return abs(dx) + abs(dy) <= RADIUS


def draw_clip(
    colour: str, shape: str, motion: str, start: tuple[int, int], size: tuple[int, int], frames: int
):
    """``frames`` RGB frames ``[H][W][3]`` (nested lists of ints) of the shape moving by `STEP` per frame."""
    height, width = size
    (mx, my), (x0, y0) = MOTIONS[motion], start
    out = []
    for f in range(frames):
        cx, cy = x0 + mx * STEP * f, y0 + my * STEP * f
        rows = []
        for y in range(height):
            rows.append(
                [COLOURS[colour] if _inside(shape, x - cx, y - cy) else BACKGROUND for x in range(width)]
            )
        out.append(rows)
    return out


def _save_png(pixels, path: Path) -> None:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.asarray(pixels, dtype=np.uint8), "RGB").save(path, optimize=False, compress_level=9)


def write_clips(out: Path) -> list[dict]:
    rng = random.Random(SEED)
    rows = []
    for n in range(N_CLIPS + N_IMAGES):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        is_image = n >= N_CLIPS
        motion = rng.choice(sorted(MOTIONS))
        height, width = (32, 32) if is_image else rng.choice(SIZES)
        travel = STEP * (FRAMES - 1)
        # Start where the whole path stays inside the frame.
        mx, my = MOTIONS[motion]
        xs = range(RADIUS + max(0, -mx * travel), width - RADIUS - max(0, mx * travel))
        ys = range(RADIUS + max(0, -my * travel), height - RADIUS - max(0, my * travel))
        start = (rng.choice(list(xs)), rng.choice(list(ys)))
        frames = draw_clip(colour, shape, motion, start, (height, width), 1 if is_image else FRAMES)
        clip = out / "clips" / f"{n:03d}"
        clip.mkdir(parents=True)
        for f, pixels in enumerate(frames):
            _save_png(pixels, clip / f"{f:03d}.png")
        if is_image:
            rows.append({"image": f"clips/{n:03d}/000.png", "caption": f"a {colour} {shape} still"})
        else:
            rows.append({"video": f"clips/{n:03d}", "caption": f"a {colour} {shape} moving {motion}"})
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def tokenizer():
    """A word-level Unigram tokenizer with T5's conventions (Metaspace, ``</s>`` appended, ``<pad>`` = 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(f"\u2581{w}", -1.0 - i * 0.01) for i, w in enumerate(WORDS)]
    vocab += [(c, -20.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("\u2581", -30.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0
    )


def write_models(out: Path) -> None:
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config

    with torch.device("meta"):
        WanTransformer3DModel(**TRANSFORMER).save_config(out / "transformer")
    tok = tokenizer()
    cond = out / "condition"
    tok.save_pretrained(cond / "tokenizer")
    UMT5Config(vocab_size=len(tok), **UMT5).save_pretrained(cond / "text_encoder")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(cond / "scheduler")
    with torch.device("meta"):
        AutoencoderKLWan(**VAE).save_config(cond / "vae")
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": json.loads((cond / "vae" / "config.json").read_text())["_diffusers_version"],
    }
    for name, lib, cls in [("tokenizer", "transformers", "T5TokenizerFast"),
                           ("text_encoder", "transformers", "UMT5EncoderModel"),
                           ("vae", "diffusers", "AutoencoderKLWan"),
                           ("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler"),
                           ("transformer", None, None)]:  # fmt: skip
        index[name] = [lib, cls]
    (cond / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def measure_latent_stats(out: Path, rows: list[dict]) -> None:
    """Per-channel mean and std of the VAE posterior means over the clips (what Wan's vae/config.json carries
    for its trained VAE), written into ``condition/vae/config.json`` so that normalised latents are ~N(0, 1)."""
    import torch

    from veomni.models.wan.condition import WanConditionModel
    from veomni.train.data.dit import load_clip, sample_frames
    from veomni.train.data.media import image_size
    from veomni.train.data.sources import RowRef

    model = WanConditionModel.from_pretrained(out / "condition", init="random", seed=TRAIN_SEED)
    means = []
    for i, row in enumerate(rows):
        ref = RowRef(str(out / "train.jsonl"), i, i + 1)
        frames, _ = sample_frames(row, ref, str(out))
        clip = load_clip(frames, (len(frames), *image_size(frames[0])), ref)
        means.append(model.encode_videos([clip])[0][0, :4].flatten(1))
    latents = torch.cat(means, dim=1)
    path = out / "condition" / "vae" / "config.json"
    config = json.loads(path.read_text())
    config["latents_mean"] = [round(float(v), 4) for v in latents.mean(dim=1)]
    config["latents_std"] = [round(float(v), 4) for v in latents.std(dim=1)]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    out = parser.parse_args(argv).out
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "quickstart_dit"
        rows = write_clips(staging)
        write_models(staging)
        measure_latent_stats(staging, rows)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staging, out)
    print(f"wrote {len(rows)} samples and the model configs to {out}")


if __name__ == "__main__":
    main()
