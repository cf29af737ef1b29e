"""DiT training data (``data.kind: dit``): captioned clips and images, batched in samples, one shape per
micro-batch.

A row is ``{"video": <directory of frame images, or a list of frame files>, "caption": str}`` or
``{"image": <file>, "caption": str}`` (jsonl or parquet). Relative paths are read from ``data.media_root``, else
from the directory of the data file holding the row. A directory's frames are its image files in name order, the
numbers in names compared by value (`frame_order`: ``2.png`` before ``10.png``). A clip is ``[3, F, H, W]``
float32 in [-1, 1]; an image is ``F = 1``.

Indexing reads every frame's header once (no pixels): a sample whose frames differ in size, or whose frame count
or resolution the VAE and the transformer's patches cannot tile (`ShapeRule`), is a `DataError` naming the file
and row. The epoch plan (`dit_micro_batches`) buckets the shuffled rows by ``(F, H, W)`` and cuts each bucket
into micro-batches of at most ``samples_per_micro_batch`` samples, so a micro-batch stacks into one tensor per
input after conditioning. Steps, DP dealing and resume follow `veomni.train.data.loader.TrainData` (the same
`rank_schedule` and state contract); the loss normaliser of a step (`Step.valid_tokens`) is its sample count over
all DP ranks. Each micro-batch carries ``noise_seed``, derived from (seed, epoch, micro-batch index) alone, so the
noise a sample gets does not depend on the DP layout and a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch.utils.data import Dataset

from veomni.train.data.loader import DataTopology, Step
from veomni.train.data.media import ImageRef, image_ref, image_size, load_image
from veomni.train.data.plan import MicroBatches, steps_in_epoch
from veomni.train.data.schedule import PlannedSteps
from veomni.train.data.sources import DataError, RowRef, RowSource

log = logging.getLogger(__name__)
STATE_FORMAT = "veomni.train.data.dit/1"
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# Each row gives a video or an image: a parquet file may hold only one of the two columns.
MEDIA_COLUMNS = ("video", "image")


@attrs.frozen
class ShapeRule:
    """What a sample's ``(F, H, W)`` must satisfy: ``F = 1 + temporal * k`` (the VAE's temporal compression)
    and ``H, W`` divisible by ``spatial * patch`` (VAE downsampling times the transformer's patch size)."""

    temporal: int
    spatial: int
    patch: tuple[int, int, int]

    def check(self, shape: tuple[int, int, int], where: str) -> None:
        f, h, w = shape
        _, ph, pw = self.patch
        lat_f = 1 + (f - 1) // self.temporal
        if (f - 1) % self.temporal or lat_f % self.patch[0]:
            raise DataError(
                f"{where}: {f} frames; expected 1 + {self.temporal}k frames (the VAE compresses time by "
                f"{self.temporal}) giving a latent frame count divisible by the patch {self.patch[0]}"
            )
        if h % (self.spatial * ph) or w % (self.spatial * pw):
            raise DataError(
                f"{where}: resolution {h}x{w} (HxW); expected H divisible by {self.spatial * ph} and W by "
                f"{self.spatial * pw} (VAE factor {self.spatial} x patch {ph}x{pw})"
            )

    def tokens(self, shape: tuple[int, int, int]) -> int:
        """Transformer tokens of a sample of ``shape``: latent ``F' * H' * W'`` over the patch volume."""
        f, h, w = shape
        lat_f, lat_h, lat_w = 1 + (f - 1) // self.temporal, h // self.spatial, w // self.spatial
        pt, ph, pw = self.patch
        return (lat_f // pt) * (lat_h // ph) * (lat_w // pw)


def frame_order(name: str) -> tuple[list[str | int], str]:
    """Sort key of a frame file name: digit runs compare by value (``2.png`` before ``10.png``, as ffmpeg's
    ``%d.png`` numbers them), the rest by character; zero-padded names keep their plain name order."""
    # re.split with a group alternates text (even places) and digit runs (odd places), so like compares with like;
    # the name itself breaks ties ("01.png" / "1.png") so that the order never depends on the directory listing.
    parts = re.split(r"(\d+)", name)
    return [int(p) if i % 2 else p for i, p in enumerate(parts)], name


def _frame_list(value: Any, root: str, ref: RowRef) -> list[str]:
    if isinstance(value, str) and value.strip():
        path = value if os.path.isabs(value) else os.path.join(root, value)
        if not os.path.isdir(path):
            raise DataError(f"{ref}: video {value!r} is not a directory of frames ({path} does not exist)")
        names = sorted((n for n in os.listdir(path) if n.lower().endswith(FRAME_SUFFIXES)), key=frame_order)
        if not names:
            raise DataError(
                f"{ref}: video directory {path} holds no frame image ({', '.join(FRAME_SUFFIXES)})"
            )
        return [os.path.join(path, n) for n in names]
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise DataError(
        f"{ref}: 'video' must be a frames directory or a non-empty list of frame files, found {value!r:.80}"
    )


def sample_frames(row: dict[str, Any], ref: RowRef, root: str) -> tuple[list[ImageRef], str]:
    """The frame references and caption of one row (see the module docstring for the row layout)."""
    caption = row.get("caption")
    if not isinstance(caption, str):
        raise DataError(f"{ref}: expected a string 'caption', found {type(caption).__name__}")
    has_video, has_image = row.get("video") is not None, row.get("image") is not None
    if has_video == has_image:
        raise DataError(
            f"{ref}: expected exactly one of 'video' (frames) and 'image', found "
            f"{'both' if has_video else 'neither'} (keys {sorted(row)})"
        )
    paths = _frame_list(row["video"], root, ref) if has_video else [row["image"]]
    return [image_ref(p, root, ref, i) for i, p in enumerate(paths)], caption


def row_root(source: RowSource, media_root: str | None, row: int) -> str:
    """The directory relative paths of row ``row`` are read from: ``media_root``, else its data file's."""
    return media_root or os.path.dirname(os.path.abspath(source.ref(row).file))


def index_dit(source: RowSource, media_root: str | None, rule: ShapeRule) -> np.ndarray:
    """``[rows, 3]`` int64 ``(F, H, W)`` of every row, from the frames' headers; every row checked."""
    shapes = np.zeros((len(source), 3), dtype=np.int64)
    for row in range(len(source)):
        ref = source.ref(row)
        frames, _ = sample_frames(source[row], ref, row_root(source, media_root, row))
        sizes = [image_size(f) for f in frames]
        if len(set(sizes)) > 1:
            odd = next(i for i, s in enumerate(sizes) if s != sizes[0])
            raise DataError(
                f"{ref}: frames of inconsistent size: frame 0 ({frames[0].path}) is {sizes[0][0]}x{sizes[0][1]} "
                f"(HxW) but frame {odd} ({frames[odd].path}) is {sizes[odd][0]}x{sizes[odd][1]}; every frame of "
                "a sample must have one size"
            )
        shape = (len(frames), *sizes[0])
        rule.check(shape, str(ref))
        shapes[row] = shape
    return shapes


def index_latents(source: RowSource, rule: ShapeRule) -> np.ndarray:
    """``[rows, 3]`` ``(F, H, W)`` of the rows of a ``veomni-dit-embed`` manifest (their ``shape`` field)."""
    shapes = np.zeros((len(source), 3), dtype=np.int64)
    for row in range(len(source)):
        ref, value = source.ref(row), source[row]
        shape = value.get("shape")
        if not (
            isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)
        ):
            raise DataError(
                f"{ref}: expected 'shape': [F, H, W] (positive ints) as veomni-dit-embed writes, found {shape!r}"
            )
        for key in ("shard", "index", "caption"):
            if key not in value:
                raise DataError(
                    f"{ref}: a veomni-dit-embed manifest row needs {key!r}; found keys {sorted(value)}"
                )
        rule.check(tuple(shape), str(ref))
        shapes[row] = shape
    return shapes


def load_latent_row(row: dict[str, Any], ref: RowRef, root: str) -> dict[str, torch.Tensor]:
    """The stored conditions of one manifest row: ``{name: tensor}`` from its shard (``prompt_embeds``,
    ``latent_params``, and for I2V ``image_condition``, ``image_embeds``)."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(root, row["shard"])
    if not os.path.isfile(path):
        raise DataError(
            f"{ref}: no such latent shard {path} (was veomni-dit-embed interrupted? run it again)"
        )
    prefix = f"{row['index']}."
    try:
        with safe_open(path, framework="pt") as f:
            out = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    except (SafetensorError, OSError) as err:  # a shard cut short (a copy or a crash mid-write)
        raise DataError(
            f"{ref}: latent shard {path} is unreadable ({err}); delete it and run veomni-dit-embed again"
        ) from None
    if "latent_params" not in out or "prompt_embeds" not in out:
        raise DataError(
            f"{ref}: shard {path} holds no latent_params / prompt_embeds for sample {row['index']}"
        )
    return out


def dit_micro_batches(
    shapes: np.ndarray, *, seed: int, epoch: int, per_micro: int, shuffle: bool
) -> MicroBatches:
    """Epoch ``epoch``'s micro-batches: rows in the seeded order, bucketed by shape (buckets in order of first
    appearance), cut into chunks of at most ``per_micro``; the chunks are then shuffled as a whole."""
    order = np.arange(len(shapes))
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    if shuffle:
        order = order[rng.permutation(len(order))]
    buckets: dict[tuple[int, ...], list[int]] = {}
    for row in order.tolist():
        buckets.setdefault(tuple(shapes[row].tolist()), []).append(row)
    chunks = [rows[i : i + per_micro] for rows in buckets.values() for i in range(0, len(rows), per_micro)]
    if shuffle:
        chunks = [chunks[i] for i in rng.permutation(len(chunks)).tolist()]
    sizes = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.fromiter((r for c in chunks for r in c), dtype=np.int64, count=int(offsets[-1]))
    return MicroBatches(rows=rows, offsets=offsets)


def noise_seed(seed: int, epoch: int, micro_batch: int) -> int:
    """The seed of micro-batch ``micro_batch`` of epoch ``epoch``'s noise generator (a 63-bit integer)."""
    return int(np.random.SeedSequence([seed, epoch, micro_batch]).generate_state(1, np.uint64)[0] >> 1)


def load_clip(frames: Sequence[ImageRef], shape: tuple[int, int, int], ref: RowRef) -> torch.Tensor:
    """``[3, F, H, W]`` float32 in [-1, 1] from the frame files (a size differing from the index: `DataError`)."""
    out = torch.empty(3, *shape, dtype=torch.float32)
    for i, frame in enumerate(frames):
        pixels = torch.from_numpy(np.asarray(load_image(frame), dtype=np.uint8).copy())
        if tuple(pixels.shape[:2]) != shape[1:]:
            raise DataError(
                f"{ref}: frame {i} ({frame}) is now {pixels.shape[0]}x{pixels.shape[1]}, but {shape[1]}x{shape[2]} "
                "when the data was indexed; was it changed during the run?"
            )
        out[:, i] = pixels.permute(2, 0, 1).float() / 127.5 - 1.0
    return out


class _DitRows(Dataset):
    """Worker side: the clips and captions of one micro-batch, keyed ``(epoch, j)``."""

    def __init__(
        self,
        source: RowSource,
        shapes: np.ndarray,
        media_root: str | None,
        plan_args: dict[str, Any],
        latents: bool,
    ) -> None:
        self.source, self.shapes, self.media_root, self.plan_args = source, shapes, media_root, plan_args
        self.latents = latents
        self._plan: tuple[int, MicroBatches] | None = None

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, j = key
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, dit_micro_batches(self.shapes, epoch=epoch, **self.plan_args))
        videos, captions, condition = [], [], {}
        rows = self._plan[1][j].tolist()
        for row in rows:
            ref, value = self.source.ref(row), self.source[row]
            root = row_root(self.source, self.media_root, row)
            if self.latents:
                for name, tensor in load_latent_row(value, ref, root).items():
                    condition.setdefault(name, []).append(tensor)
                captions.append(value["caption"])
                continue
            frames, caption = sample_frames(value, ref, root)
            videos.append(load_clip(frames, tuple(self.shapes[row].tolist()), ref))
            captions.append(caption)
        batch = {
            "captions": captions,
            "rows": rows,
            "noise_seed": noise_seed(self.plan_args["seed"], epoch, j),
        }
        return batch | ({"condition": condition} if self.latents else {"videos": videos})


@attrs.frozen(eq=False)
class DitStep(Step):
    """A `Step` of DiT data. ``valid_tokens`` is the step's sample count over all DP ranks (the loss normaliser),
    ``tokens`` its transformer tokens; ``sample_tokens`` (the base field) lists every sample's transformer tokens
    over all DP ranks (FLOPs)."""


class DitData(PlannedSteps):
    """This rank's DiT training steps (the `veomni.train.data.TrainData` interface: iterate, ``state_dict``,
    ``load_state_dict``, ``total_steps``, ``summary``).

    Args:
        source: the rows; media_root: see the module docstring; rule: the shape rule of the model.
        latents: the rows are a ``veomni-dit-embed`` manifest (``data.kind: dit_latents``): micro-batches carry
            the stored ``condition`` lists instead of ``videos``.
        topology: this rank's DP position (SP peers share micro-batches).
        samples_per_micro_batch, grad_accum: the batch contract; seed, shuffle: the per-epoch order.
        num_workers: DataLoader workers decoding frames (0: in process); pin_memory: for GPU copies.
    """

    def __init__(
        self,
        source: RowSource,
        *,
        media_root: str | None,
        rule: ShapeRule,
        topology: DataTopology,
        samples_per_micro_batch: int,
        grad_accum: int,
        seed: int,
        shuffle: bool,
        num_workers: int = 0,
        pin_memory: bool = False,
        latents: bool = False,
    ) -> None:
        self.source, self.rule, self.topology, self.grad_accum = source, rule, topology, grad_accum
        self.num_workers, self.pin_memory = num_workers, pin_memory
        # Offline manifests name their shards relative to themselves, whatever media_root says.
        media_root = None if latents else media_root
        self.shapes = index_latents(source, rule) if latents else index_dit(source, media_root, rule)
        self._plan_args = {"seed": seed, "per_micro": samples_per_micro_batch, "shuffle": shuffle}
        self._rows = _DitRows(source, self.shapes, media_root, self._plan_args, latents)
        self._tokens = np.array([rule.tokens(tuple(s)) for s in self.shapes.tolist()], dtype=np.int64)
        self._init_schedule()
        if self.steps_in_epoch(0) == 0:
            raise DataError(
                f"the training data makes {len(self.plan(0))} micro-batches of <= {samples_per_micro_batch} "
                f"samples of one shape, fewer than one step needs (grad_accum {grad_accum} x dp "
                f"{topology.dp_size}); lower train.samples_per_step"
            )

    def _make_plan(self, epoch: int) -> MicroBatches:
        return dit_micro_batches(self.shapes, epoch=epoch, **self._plan_args)

    def __iter__(self) -> Iterator[DitStep]:
        for step, epoch, micro, rows in self._scheduled_steps(self._rows, "DitData"):
            tokens = self._tokens[rows]
            yield DitStep(
                step=step, epoch=epoch, micro_batches=micro, tokens=int(tokens.sum()), valid_tokens=len(rows),
                sample_tokens=tuple(tokens.tolist()),
            )  # fmt: skip

    def _digest(self) -> str:
        h = hashlib.sha256(self.shapes.tobytes())
        for file in self.source.files:
            h.update(f"{file.path}:{len(file)}".encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """Position after the last step handed out, plus what must match for it to mean the same data."""
        return {
            "format": STATE_FORMAT, "epoch": self._epoch, "cursor": self._cursor, "step": self._step,
            **{k: v for k, v in self._plan_args.items()}, "index_digest": self._digest(),
            "dp_size": self.topology.dp_size, "grad_accum": self.grad_accum,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the same data, seed, shuffle and micro-batch size (else a `DataError`)."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"data state has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        mine = {**self._plan_args, "index_digest": self._digest()}
        bad = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if bad:
            raise DataError(
                "cannot resume the data position, the data or its order changed: " + "; ".join(bad)
            )
        self._epoch, self._cursor, self._step = int(state["epoch"]), int(state["cursor"]), int(state["step"])
        self._generation += 1

    def summary(self) -> dict[str, Any]:
        """Numbers for the start-of-run log: samples, shapes, micro-batches and steps per epoch."""
        plan = self.plan(0)
        used = steps_in_epoch(len(plan), 0, self.per_step) * self.per_step
        shapes = sorted({tuple(s) for s in self.shapes.tolist()})
        return {
            "samples": len(self.shapes), "shapes (F, H, W)": shapes, "tokens_per_epoch": int(self._tokens.sum()),
            "micro_batches_per_epoch": len(plan), "micro_batches_left_out_per_epoch": len(plan) - used,
            "steps_per_epoch": self.steps_in_epoch(0), "grad_accum": self.grad_accum,
        }  # fmt: skip
