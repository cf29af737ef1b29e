"""Write the vision-language quickstart assets of veomni-train: synthetic shape pictures, conversations about them
and a Qwen3-VL-style processor directory.

Usage: ``uv run python tools/make_quickstart_vlm_data.py [--out DIR]`` (default: the package's
``veomni/train/assets/quickstart_vlm``). The output is a pure function of this file, of the text quickstart's
tokenizer (``assets/quickstart/tokenizer``, written by tools/make_quickstart_data.py) and of the locked Pillow
and tokenizers versions: a seeded ``random.Random`` chooses everything, so running it again reproduces the
committed files byte for byte (tests/train/test_quickstart_vlm.py checks that).

What is written:
    images/*.png             32x32 RGB pictures: one circle, square or triangle in one of six colours at one of
                             five places (the four quadrants or the centre), in two sizes.
    train.jsonl, eval.jsonl  ``{"messages": [...]}`` rows whose user content lists ``{"type": "image", "image":
                             "images/NAME.png"}`` and text parts (paths relative to ``data.media_root``): captions,
                             shape / colour / place questions, two-picture comparisons and a few text-only rows.
                             The eval rows ask about pictures the training rows never show.
    processor/               the quickstart tokenizer plus the Qwen3-VL vision tokens (``<|vision_start|>``,
                             ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``, ids 1024..1027), a ChatML
                             template that renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``
                             (as Qwen3-VL's own template does) and a PIL ``Qwen2VLImageProcessorPil`` (patch 8,
                             merge 2: a 32x32 picture is a 4x4 patch grid, 2x2 = 4 tokens in the language model, one per
                             quadrant).

Why PNG files plus jsonl rather than parquet with inline bytes: the rows are exactly what a user writes for their
own data (a relative path under ``data.media_root``), every picture opens in any viewer, and the ~200 files of a
few hundred bytes each stay far below the size budget.
"""

from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "packages/veomni-train/src/veomni/train/assets"
DEFAULT_OUT = ASSETS / "quickstart_vlm"
TEXT_TOKENIZER = ASSETS / "quickstart" / "tokenizer"
SEED = 20260905
SIZE = 32  # picture side in pixels
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 220),
    "yellow": (235, 200, 40),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
# Place name -> centre of the shape in pixels.
PLACES = {
    "top left": (8, 8),
    "top right": (24, 8),
    "bottom left": (8, 24),
    "bottom right": (24, 24),
    "centre": (16, 16),
}
TRAIN_SIZES, EVAL_SIZE = (12, 16), 14  # shape side in pixels; eval pictures use a size training never shows
BACKGROUND = (240, 240, 236)


def draw(shape: str, colour: str, place: str, side: int) -> bytes:
    """PNG bytes of one ``SIZE`` x ``SIZE`` picture: ``shape`` of ``side`` pixels in ``colour`` at ``place``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    x, y = PLACES[place]
    half = side // 2
    box = (x - half, y - half, x + half - 1, y + half - 1)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x, y - half), (x - half, y + half - 1), (x + half - 1, y + half - 1)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _where(place: str) -> str:
    return "in the centre" if place == "centre" else f"in the {place}"


def _questions(shape: str, colour: str, place: str) -> dict[str, tuple[str, str]]:
    """Question kind -> (question, answer) about one picture."""
    return {
        "caption": ("Describe the image.", f"A {colour} {shape} {_where(place)}."),
        "shape": ("What shape is this?", f"A {shape}."),
        "colour": (f"What colour is the {shape}?", f"It is {colour}."),
        "place": (f"Where is the {shape}?", f"It is {_where(place)}."),
    }


def _single(rng: random.Random, name: str, shape: str, colour: str, place: str) -> dict:
    """A caption, or one to three of the shape / colour / place questions (in that order, so that no answer can
    be copied from an earlier one) about one picture, the picture in the first user turn. Several answers per
    picture give the tower more supervision per vision token than one."""
    questions = _questions(shape, colour, place)
    if rng.random() < 0.25:
        kinds = ["caption"]
    else:
        kinds = [k for k in ("shape", "colour", "place") if rng.random() < 0.6] or [
            rng.choice(("shape", "colour"))
        ]
    messages: list[dict] = []
    for turn, kind in enumerate(kinds):
        question, answer = questions[kind]
        content: list[dict] | str = question
        if turn == 0:
            content = [{"type": "image", "image": name}, {"type": "text", "text": question}]
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def _pair(first: tuple, second: tuple) -> dict:
    """Do two pictures show the same shape? ``first``/``second`` are ``(name, shape, colour, place)``."""
    (a, shape_a, _, _), (b, shape_b, _, _) = first, second
    answer = f"Yes, both are {shape_a}s." if shape_a == shape_b else f"No, a {shape_a} and a {shape_b}."
    content = [
        {"type": "image", "image": a},
        {"type": "image", "image": b},
        {"type": "text", "text": "Do the two images show the same shape?"},
    ]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def _text_only(rng: random.Random) -> dict:
    """A row without pictures, so that some micro-batches hold none (the tower's dummy forward runs)."""
    colours = rng.sample(sorted(COLOURS), 3)
    if rng.random() < 0.5:
        question, answer = "Name three colours.", f"{colours[0].capitalize()}, {colours[1]} and {colours[2]}."
    else:
        question, answer = "Name the three shapes.", "Circle, square and triangle."
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def make_assets(rng: random.Random) -> tuple[dict[str, bytes], list[dict], list[dict]]:
    """``(pictures by relative path, train rows, eval rows)``, all drawn from ``rng``."""
    pictures: dict[str, bytes] = {}
    train_images, eval_images = [], []
    combos = [(s, c, p) for s in SHAPES for c in COLOURS for p in PLACES]
    for shape, colour, place in combos:
        for side in TRAIN_SIZES:
            name = f"images/{shape}_{colour}_{place.replace(' ', '_')}_{side}.png"
            pictures[name] = draw(shape, colour, place, side)
            train_images.append((name, shape, colour, place))
    for shape, colour, place in rng.sample(combos, 30):
        name = f"images/{shape}_{colour}_{place.replace(' ', '_')}_{EVAL_SIZE}.png"
        pictures[name] = draw(shape, colour, place, EVAL_SIZE)
        eval_images.append((name, shape, colour, place))

    train = [_single(rng, *image) for image in train_images for _ in range(2)]
    train += [_pair(*rng.sample(train_images, 2)) for _ in range(30)]
    train += [_text_only(rng) for _ in range(20)]
    rng.shuffle(train)
    evaluation = [_single(rng, *image) for image in eval_images]
    evaluation += [_pair(*rng.sample(eval_images, 2)) for _ in range(6)]
    return pictures, train, evaluation


def write_processor(out: Path) -> None:
    """The text quickstart's tokenizer with the vision tokens and template, and the PIL image processor."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(TEXT_TOKENIZER))
    first = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    if ids != list(range(first, first + len(VISION_TOKENS))):
        raise RuntimeError(f"expected the vision tokens at ids {first}.., found {ids}")
    tokenizer.chat_template = CHAT_TEMPLATE
    # from_pretrained records how it was called (HF_HUB_OFFLINE shows up as local_files_only); the shipped config
    # must not depend on the environment that wrote it.
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out)
    # 32x32 pixels stay 32x32: a multiple of patch * merge = 16, inside [min_pixels, max_pixels].
    processor = Qwen2VLImageProcessorPil(
        patch_size=8,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
    )
    processor.save_pretrained(out)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    pictures, train, evaluation = make_assets(random.Random(SEED))
    (out / "images").mkdir(parents=True, exist_ok=True)
    for name, data in pictures.items():
        (out / name).write_bytes(data)
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "eval.jsonl", evaluation)
    write_processor(out / "processor")
    print(f"wrote {len(pictures)} pictures, {len(train)} train rows and {len(evaluation)} eval rows to {out}")


if __name__ == "__main__":
    main()
