"""``veomni-dit-embed RECIPE --out DIR [--shard-size N] [--section.field=value ...]``: encode a dit recipe's data
once with its frozen condition models, so that training reads the conditions from disk and keeps the text
encoder and VAE off the GPUs (one process, or every rank under ``torchrun``: shards are dealt round-robin).

Written to DIR::

    embed.json                 what was encoded with (condition dir, mode, prompt length, dtype, init, data digest)
    shards/NNNNN.safetensors   per sample ``<row>.prompt_embeds`` [1, L, D], ``<row>.latent_params`` [1, 2z, F', H',
                               W'] float32 (the VAE posterior's mean and log-variance), I2V also ``image_condition``
                               and ``image_embeds`` -- exactly the condition model's ``get_condition`` outputs
                               (the family's `veomni.models.family.DiffusionRules.condition_model`)
    empty_prompt.safetensors   the empty prompt's embeddings (prompt dropout)
    latents.jsonl              the manifest, written last: ``{"shard", "index", "shape": [F, H, W], "caption"}``

Resume: a shard is written to a temporary name and renamed, so an interrupted run leaves only whole shards; run
the same command again and it encodes only the missing ones (``embed.json`` must match, else an error). Train on
the result with ``--data.kind=dit_latents --data.train_files=[DIR/latents.jsonl]``: the noise, timesteps, prompt
dropout and posterior sampling stay per step (`veomni.train.tasks.dit.DitTask`), so an offline run with the same
seed trains on the same inputs as an online one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from veomni.train.preflight import PreflightError
from veomni.train.recipe import Recipe, RecipeError, load_recipe

log = logging.getLogger(__name__)
FORMAT = "veomni.dit_latents/1"
MANIFEST, META, EMPTY, SHARDS = "latents.jsonl", "embed.json", "empty_prompt.safetensors", "shards"


def _meta(recipe: Recipe, files_digest: str, samples: int, shard_size: int) -> dict[str, Any]:
    d = recipe.dit
    meta = {
        "format": FORMAT, "condition": d.condition, "condition_init": d.condition_init, "mode": d.mode,
        "max_sequence_length": d.max_sequence_length, "text_encoder_dtype": d.text_encoder_dtype,
        "data": list(recipe.data.train_files), "data_digest": files_digest, "samples": samples,
        "shard_size": shard_size,
    }  # fmt: skip
    if d.condition_init == "random":
        meta["seed"] = recipe.train.seed  # random condition models are a function of the seed
    return meta


def _digest(shapes: Any, files: list[str]) -> str:
    h = hashlib.sha256(shapes.tobytes())
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    # On disk before the rename: a crash must not leave a short file under the final name.
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shard_done(path: Path) -> bool:
    """Whether ``path`` is a whole shard: it exists and its header opens (a shard cut short, by a copy or a crash,
    is encoded again)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError):
        return False
    return True


def embed(recipe: Recipe, out: str | os.PathLike, shard_size: int = 64) -> dict[str, Any]:
    """Encode ``recipe``'s data into ``out`` (see the module docstring); every rank must call it.

    Returns:
        ``{"samples", "shards", "encoded"}``: totals, and the shards this rank encoded in this call.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    from veomni.train.data.dit import MEDIA_COLUMNS, index_dit, load_clip, row_root, sample_frames
    from veomni.train.data.sources import RowSource
    from veomni.train.loop import setup_distributed
    from veomni.train.metrics import format_duration
    from veomni.train.run_log import RunClock
    from veomni.train.tasks.dit_setup import (
        check_compatible,
        condition_configs,
        dit_rules,
        load_condition,
        shape_rule,
        transformer_config,
        with_condition_mode,
    )

    if recipe.model.task != "dit" or recipe.data.kind != "dit":
        raise PreflightError(
            f"veomni-dit-embed encodes a dit recipe's clips (model.task=dit, data.kind=dit); found "
            f"model.task={recipe.model.task!r}, data.kind={recipe.data.kind!r}"
        )
    if shard_size < 1:
        raise PreflightError(f"--shard-size: expected >= 1, found {shard_size}")
    device = setup_distributed(recipe.train.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out)
    config = transformer_config(recipe)
    rules = dit_rules(config)
    recipe = with_condition_mode(recipe, rules)
    cond = condition_configs(recipe, rules)
    check_compatible(config, cond, recipe, rules)
    data = recipe.data
    source = RowSource(data.train_files, data.file_format, ["caption"], MEDIA_COLUMNS)
    shapes = index_dit(source, data.media_root, shape_rule(config, cond))
    meta = _meta(recipe, _digest(shapes, list(data.train_files)), len(shapes), shard_size)
    if (out / META).is_file():
        saved = json.loads((out / META).read_text())
        diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in meta.items() if saved.get(k) != v]
        if diff:
            raise PreflightError(
                f"{out} holds conditions encoded from another recipe or data ({'; '.join(diff)}); use another "
                "--out or remove it"
            )
    dist.barrier()
    if rank == 0:
        (out / SHARDS).mkdir(parents=True, exist_ok=True)
        _write_atomic(out / META, lambda p: p.write_text(json.dumps(meta, indent=1) + "\n"))
    dist.barrier()
    condition = load_condition(recipe, rules, device)
    n_shards = math.ceil(len(shapes) / shard_size)
    mine = list(range(rank, n_shards, world))
    todo = [k for k in mine if not _shard_done(out / SHARDS / f"{k:05d}.safetensors")]
    # A bar on a terminal; redirected (a log file, a pipe), one plain line per shard instead of `\r` redraws.
    progress = (
        tqdm(total=len(mine), initial=len(mine) - len(todo), desc="embed", unit="shard")
        if rank == 0 and sys.stderr.isatty()
        else None
    )
    clock = RunClock(len(mine) - len(todo), len(mine))
    for i, k in enumerate(todo):
        tensors: dict[str, torch.Tensor] = {}
        for row in range(k * shard_size, min(len(shapes), (k + 1) * shard_size)):
            ref = source.ref(row)
            frames, caption = sample_frames(source[row], ref, row_root(source, data.media_root, row))
            clip = load_clip(frames, tuple(shapes[row].tolist()), ref)
            for name, values in condition.get_condition([caption], [clip]).items():
                tensors[f"{row}.{name}"] = values[0].detach().contiguous().cpu()
        _write_atomic(out / SHARDS / f"{k:05d}.safetensors", lambda p, t=tensors: save_file(t, str(p)))
        if progress is not None:
            progress.update(1)
        elif rank == 0:
            done = len(mine) - len(todo) + i + 1
            eta = clock.eta(done)
            log.info(
                "embed: %d/%d shards of rank 0 | elapsed %s | eta %s",
                done, len(mine), format_duration(clock.elapsed()), "n/a" if eta is None else format_duration(eta),
            )  # fmt: skip
    if progress is not None:
        progress.close()
    dist.barrier()
    if rank == 0:
        empty = {"prompt_embeds": condition.empty_prompt_embeds().detach().contiguous().cpu()}
        _write_atomic(out / EMPTY, lambda p: save_file(empty, str(p)))
        rows = []
        for row in range(len(shapes)):
            rows.append(json.dumps({
                "shard": f"{SHARDS}/{row // shard_size:05d}.safetensors", "index": row,
                "shape": shapes[row].tolist(), "caption": source[row]["caption"],
            }))  # fmt: skip
        _write_atomic(out / MANIFEST, lambda p: p.write_text("\n".join(rows) + "\n"))
    dist.barrier()
    return {"samples": len(shapes), "shards": n_shards, "encoded": len(todo)}


def check_latents(recipe: Recipe) -> None:
    """A ``data.kind: dit_latents`` recipe reads one complete manifest encoded with its own condition settings
    (else a `PreflightError` naming what differs)."""
    files = recipe.data.train_files
    if len(files) != 1 or Path(files[0]).name != MANIFEST:
        raise PreflightError(
            f"data.kind=dit_latents: data.train_files must be the one {MANIFEST} veomni-dit-embed writes, found "
            f"{list(files)}"
        )
    root = Path(files[0]).parent
    if not (root / META).is_file():
        raise PreflightError(f"{root} has no {META}: not a veomni-dit-embed output directory")
    if not (root / MANIFEST).is_file():
        raise PreflightError(
            f"{root}: veomni-dit-embed did not finish (no {MANIFEST}); run it again to complete it"
        )
    saved = json.loads((root / META).read_text())
    d = recipe.dit
    now = {"condition": d.condition, "condition_init": d.condition_init, "mode": d.mode,
           "max_sequence_length": d.max_sequence_length, "text_encoder_dtype": d.text_encoder_dtype}  # fmt: skip
    if d.condition_init == "random":
        now["seed"] = recipe.train.seed
    diff = [f"dit.{k if k != 'seed' else 'seed (train.seed)'}: encoded with {saved.get(k)!r}, recipe has {v!r}"
            for k, v in now.items() if saved.get(k) != v]  # fmt: skip
    if diff:
        raise PreflightError(
            f"{root / META}: the conditions were encoded with other settings: " + "; ".join(diff)
        )


def load_empty_prompt(manifest: str, device: torch.device) -> torch.Tensor:
    """The stored ``[1, L, D]`` empty-prompt embeddings beside ``manifest``."""
    from safetensors.torch import load_file

    return load_file(str(Path(manifest).parent / EMPTY))["prompt_embeds"].to(device)


USAGE = "usage: veomni-dit-embed RECIPE --out DIR [--shard-size N] [--section.field=value ...]\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or "-h" in args or "--help" in args:
        print(USAGE + __doc__)
        return 0 if args else 2
    out, shard_size, rest = None, 64, []
    it = iter(args[1:])
    for item in it:
        key, eq, value = item.partition("=")
        if key in ("--out", "--shard-size"):
            value = value if eq else next(it, None)
            if value is None:
                print(f"veomni-dit-embed: {key} needs a value\n{USAGE}", file=sys.stderr)
                return 2
            if key == "--out":
                out = value
            elif not value.isdigit() or int(value) < 1:
                print(
                    f"veomni-dit-embed: --shard-size: expected a whole number >= 1, found {value!r}",
                    file=sys.stderr,
                )
                return 2
            else:
                shard_size = int(value)
        else:
            rest.append(item)
    if out is None:
        print(f"veomni-dit-embed: --out DIR is required\n{USAGE}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")  # fmt: skip
    from veomni.train.data.sources import DataError

    try:
        result = embed(load_recipe(args[0], rest), out, shard_size)
    except (RecipeError, PreflightError, DataError) as err:
        print(f"veomni-dit-embed: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Each shard is written atomically, so what is on disk is whole; running again encodes the rest.
        print("veomni-dit-embed: interrupted: the shards written so far are kept; run it again to go on",
              file=sys.stderr)  # fmt: skip
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(
            f"done: {result['samples']} samples in {result['shards']} shards under {out} ({result['encoded']} "
            f"encoded now on rank 0); train with "
            f"--data.kind=dit_latents --data.train_files=[{Path(out) / MANIFEST}]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
