"""``veomni-data-preview RECIPE [--section.field=value ...] [--n N]``: decoded packed batches, loss mask visible.

Builds the recipe's data pipeline exactly as training does (same index, order, packing and dealing) and prints
the dataset's exact token counts, the packing and step arithmetic, then the first N micro-batches of one DP rank:
each sample decoded, with the tokens that are not trained shown dimmed (on a terminal) or inside ``[[ ]]``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from veomni.train.data.build import build_eval_data, build_train_data, total_steps
from veomni.train.data.encode import load_tokenizer
from veomni.train.data.loader import DataTopology
from veomni.train.data.packing import unpack
from veomni.train.data.sources import DataError
from veomni.train.hub import fetch_hub_sources
from veomni.train.preflight import PreflightError, check_tokenizer_dir
from veomni.train.recipe import RecipeError, load_recipe, recipe_help

USAGE = """usage: veomni-data-preview RECIPE [--section.field=value ...] [options]

RECIPE is a YAML file or a built-in recipe name (quickstart). Options:
  --n N            micro-batches to print (default 2)
  --samples K      samples to print per micro-batch (default 4; 0: all)
  --eval           preview the evaluation data instead of the training data
  --dp-size D      data-parallel size to deal for (default 1); --dp-rank R picks the rank shown (default 0)
  --color WHEN     auto | always | never: dim the untrained tokens instead of bracketing them (default auto)
  --help           this text and every recipe field
"""

DIM, RESET = "\x1b[2m", "\x1b[0m"
OPTIONS = {"--n": int, "--samples": int, "--dp-size": int, "--dp-rank": int, "--color": str}


def parse_args(argv: Sequence[str]) -> tuple[str, list[str], dict[str, Any]]:
    """``(recipe, overrides, options)``; recipe overrides are the dotted ``--a.b`` items."""
    options: dict[str, Any] = {"--n": 2, "--samples": 4, "--dp-size": 1, "--dp-rank": 0, "--color": "auto"}
    options["--eval"] = False
    positional, overrides = [], []
    i = 0
    while i < len(argv):
        item = argv[i]
        name, eq, value = item.partition("=")
        if name in OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise RecipeError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            try:
                options[name] = OPTIONS[name](value)
            except ValueError:
                raise RecipeError(f"{name}: expected {OPTIONS[name].__name__}, found {value!r}") from None
        elif item == "--eval":
            options["--eval"] = True
        elif item.startswith("--"):
            overrides.append(item)
            if not eq and i + 1 < len(argv):
                overrides.append(argv[i + 1])
                i += 1
        else:
            positional.append(item)
        i += 1
    if len(positional) != 1:
        raise RecipeError(f"expected exactly one RECIPE argument, found {positional}\n{USAGE}")
    if options["--color"] not in ("auto", "always", "never"):
        raise RecipeError(f"--color: expected auto, always or never, found {options['--color']!r}")
    # Checked here so that a bad value is a usage error (status 2), not a traceback from deep in the pipeline.
    for name in ("--n", "--samples", "--dp-rank"):
        if options[name] < 0:
            raise RecipeError(f"{name}: expected >= 0, found {options[name]}")
    if not 0 <= options["--dp-rank"] < options["--dp-size"]:
        raise RecipeError(
            f"--dp-rank {options['--dp-rank']} is out of range for --dp-size {options['--dp-size']} "
            "(0 <= rank < size)"
        )
    return positional[0], overrides, options


def render_sample(
    tokenizer: Any,
    ids: np.ndarray,
    trained: np.ndarray,
    color: bool,
    image_token_id: int | None = None,
    video_token_id: int | None = None,
) -> str:
    """Decode ``ids`` run by run: trained runs plain, the others dimmed (``color``) or inside ``[[ ]]``; a run of
    ``image_token_id`` / ``video_token_id`` placeholders (multimodal data) is shown as ``<image xN>`` /
    ``<video xN>`` (a video has one run per temporal patch, after its timestamp)."""
    span = np.zeros(len(ids), dtype=np.int8)  # 0 text, 1 image, 2 video
    for kind, token_id in ((1, image_token_id), (2, video_token_id)):
        if token_id is not None:
            span[ids == token_id] = kind

    def decode(a: int, b: int) -> str:  # the tokens a..b-1 of one loss run, image and video spans collapsed
        pieces, start = [], a
        for end in range(a + 1, b + 1):
            if end == b or span[end] != span[start]:
                if span[start]:
                    pieces.append(f"<{'image' if span[start] == 1 else 'video'} x{end - start}>")
                else:
                    pieces.append(tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False))
                start = end
        return "".join(pieces)

    parts = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            text = decode(start, end)
            if not trained[start]:
                text = f"{DIM}{text}{RESET}" if color else f"[[{text}]]"
            parts.append(text)
            start = end
    return "".join(parts)


def _print_batch(
    out: TextIO, label: str, batch: dict, budget: int, tokenizer: Any, source: Any, opts: dict
) -> None:
    if batch["is_padding"]:
        out.write(f"\n=== {label}: a filler batch (no samples) that keeps this rank in step with its peers\n")
        return
    samples = unpack(batch)
    trained = int(batch["num_valid_tokens"])
    out.write(
        f"\n=== {label}: {len(samples)} samples, {batch['seq_len']} tokens "
        f"({100 * batch['seq_len'] / budget:.1f}% of {budget}), {trained} trained, "
        f"max_seqlen {batch['max_seqlen']}, {len(batch['cu_seqlens']) - 1} attention segments\n"
    )
    image_token_id = video_token_id = None
    if "image_grid_thw" in batch:  # multimodal: the vision side of the micro-batch
        grids, video_grids = batch["image_grid_thw"], batch.get("video_grid_thw")
        videos = "" if video_grids is None else f", {len(video_grids)} videos (grids {video_grids.tolist()})"
        out.write(
            f"    vision: {0 if grids is None else len(grids)} images, {batch['num_patches']} patches "
            f"(grids {[] if grids is None else grids.tolist()}){videos}\n"
        )
        from veomni.train.data.multimodal import VIDEO_TOKEN, image_token_of

        image_token_id = tokenizer.convert_tokens_to_ids(image_token_of(tokenizer))
        video_token_id = tokenizer.convert_tokens_to_ids(
            getattr(tokenizer, "video_token", None) or VIDEO_TOKEN
        )
        if video_token_id == tokenizer.unk_token_id:
            video_token_id = None
    limit = opts["--samples"] or len(samples)
    color = opts["--color"] == "always" or (opts["--color"] == "auto" and out.isatty())
    for k, ((ids, mask), row) in enumerate(zip(samples[:limit], batch["sample_index"], strict=False)):
        out.write(f"--- sample {k}: {source.ref(row)}, {len(ids)} tokens, {int(mask.sum())} trained\n")
        out.write(
            render_sample(tokenizer, ids, mask, color, image_token_id, video_token_id).rstrip("\n") + "\n"
        )
    if len(samples) > limit:
        out.write(f"--- ... {len(samples) - limit} more samples (--samples 0 shows all)\n")


def preview(argv: Sequence[str], out: TextIO | None = None) -> None:
    """Run the preview for command-line ``argv`` (without the program name), writing to ``out`` (stdout)."""
    out = sys.stdout if out is None else out
    if any(a in ("-h", "--help") for a in argv):
        out.write(USAGE + "\n" + recipe_help())
        return
    source_name, overrides, opts = parse_args(argv)
    # Hub ids are fetched (configs and tokenizer files only) as the trainer would; a bad one is one line.
    recipe = fetch_hub_sources(load_recipe(source_name, overrides), weights=False)
    if recipe.model.tokenizer_path is not None and os.path.exists(recipe.model.tokenizer_path):
        check_tokenizer_dir(
            Path(recipe.model.tokenizer_path),
            "model.tokenizer" if recipe.model.tokenizer else "model.weights",
        )
    tokenizer = load_tokenizer(recipe.model.tokenizer_path, recipe.data.chat_template)
    topology = DataTopology(dp_rank=opts["--dp-rank"], dp_size=opts["--dp-size"])
    budget = recipe.train.tokens_per_micro_batch
    out.write(f"recipe: {source_name}\ntokenizer: {recipe.model.tokenizer_path} (vocab {len(tokenizer)})\n")
    options: dict[str, Any] = {}
    if recipe.data.kind == "multimodal":  # laid out by the model's family: its data rules and config
        from veomni.models.families import data_rules
        from veomni.train.model_setup import model_config

        config = model_config(recipe)
        options = {"data_rules": data_rules(config.model_type), "model_config": config}
    if opts["--eval"]:
        data = build_eval_data(recipe, tokenizer, topology, **options)
        if data is None:
            raise RecipeError("--eval: the recipe has no data.eval_files")
        out.write(
            f"eval data: {data.index.num_samples} samples, {data.index.total_tokens:,} tokens "
            f"({data.valid_tokens:,} trained), {len(data.plan)} micro-batches, {len(data)} per rank\n"
        )
        batches = [
            (f"eval micro-batch {i} (dp rank {topology.dp_rank})", b)
            for i, b in zip(range(opts["--n"]), data, strict=False)
        ]
        source = data.source
    else:
        data = build_train_data(recipe, tokenizer, topology, **options)
        s = data.summary()
        if "stream" in s:  # a streaming dataset: no index, so no counts before it is read
            out.write(
                f"train data: the stream {s['stream']}, packed as it is read; steps: {recipe.train.steps}\n"
            )
        else:
            _write_summary(out, s, recipe, budget, topology, total_steps(recipe, data))
        batches = []
        steps = iter(data)
        while len(batches) < opts["--n"]:
            step = next(steps)
            for g, b in enumerate(step.micro_batches):
                label = f"step {step.step} micro-batch {g} (dp rank {topology.dp_rank}, epoch {step.epoch})"
                batches.append((label, b))
        batches = batches[: opts["--n"]]
        source = data.source
    if recipe.parallel.sp > 1:
        out.write(
            f"sequence parallel: each row is padded to a multiple of sp={recipe.parallel.sp} and split into "
            f"{recipe.parallel.sp} contiguous slices (shown here unsplit)\n"
        )
    legend = (
        "dimmed" if opts["--color"] == "always" or (opts["--color"] == "auto" and out.isatty()) else "[[ ]]"
    )
    out.write(f"legend: trained tokens as plain text, tokens without loss {legend}\n")
    for label, batch in batches:
        _print_batch(out, label, batch, budget, tokenizer, source, opts)


def _write_summary(out: TextIO, s: dict, recipe: Any, budget: int, topology: Any, steps: int) -> None:
    """The indexed training data's counts, packing and step arithmetic."""
    out.write(
        f"train data: {s['rows']:,} rows, {s['samples']:,} samples, {s['tokens']:,} tokens "
        f"({s['trained_tokens']:,} trained), {s['truncated']} truncated, {s['dropped']} dropped "
        f"(max_seq_len {recipe.data.max_seq_len}, overlong: {recipe.data.overlong})\n"
        f"packing: {s['micro_batches_per_epoch']} micro-batches per epoch of <= {budget:,} tokens "
        f"({100 * s['packing_efficiency']:.1f}% full); grad_accum {s['grad_accum']} x dp {topology.dp_size} "
        f"per step; {s['steps_per_epoch']} steps per epoch, {s['micro_batches_left_out_per_epoch']} "
        f"micro-batch(es) left out at the epoch's end\n"
        f"steps: {steps}"
        + (f" ({recipe.train.epochs} epochs)" if recipe.train.steps is None else " (train.steps)")
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; user errors print one message and exit with status 2."""
    try:
        preview(sys.argv[1:] if argv is None else list(argv))
    except (RecipeError, DataError, PreflightError) as err:
        print(f"veomni-data-preview: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("veomni-data-preview: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
