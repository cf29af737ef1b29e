"""Qwen2-VL / Qwen2.5-VL video preprocessing, without torchvision.

transformers 5.23's ``Qwen2VLVideoProcessor`` (both families' video processor) imports torchvision at module load, so
its settings are read here from the config files and its rule restated step by step:

1. **Frames.** With frame sampling (the processor's ``do_sample_frames`` with its ``fps``, or the recipe's
   ``data.video_fps``): a clip of ``N`` frames at ``F`` fps keeps ``n = floor(min(max(N / F * fps, min_frames),
   floor(min(max_frames, N) / T) * T, N) / T) * T`` frames at ``arange(0, N, N / n).int()`` (``T`` the temporal
   patch size; upstream's ``sample_frames``). Without (upstream's default, ``do_sample_frames=False``) every
   frame is kept; a clip above ``max_frames`` is then refused rather than silently fed whole.
2. **Resize**: every frame to one ``(H', W')`` by the IMAGE ``smart_resize`` (per frame: ``H' * W'`` within
   ``[size.shortest_edge, size.longest_edge]``, multiples of ``patch * merge``); with ``cap_pixels_per_frame``
   the ceiling becomes ``max(min(longest_edge, int(max_video_tokens * factor**2 * 0.9) * T // n),
   int(shortest_edge * 1.05))``.
3. **Rescale, normalise, patchify**: as Qwen3-VL's (`veomni.models.qwen3_vl.video.frames_to_rows`); the frame
   count is padded to a multiple of ``T`` by repeating the last frame.
4. **Placeholders**: each ``<|video_pad|>`` becomes ``t * h * w / merge**2`` ``<|video_pad|>`` (one run, inside the
   template's ``<|vision_start|>``/``<|vision_end|>``). Qwen2.5-VL's processor also returns
   ``second_per_grid_ts = T / sampled_fps`` per clip (``sampled_fps = n / N * F``), which its positions read.

`Qwen2VLVideoRule` holds the settings as plain values (picklable into spawned DataLoader workers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from veomni.models.qwen3_vl.video import _RESAMPLE, frames_to_rows

DEFAULTS: dict[str, Any] = {
    "resample": 3,  # PILImageResampling.BICUBIC
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 4,
    "max_frames": 768,
    "do_sample_frames": False,
    "fps": None,
    "num_frames": None,
    "cap_pixels_per_frame": None,
    "max_video_tokens": 128000,
}
"""transformers 5.23's ``Qwen2VLVideoProcessor`` class defaults (and its base's ``rescale_factor``, ``fps``,
``num_frames``), for keys a config file leaves out; a test compares them with the installed source."""

PROCESSOR_TYPES = ("Qwen2VLVideoProcessor",)
"""``video_processor_type`` values whose settings this rule reads (Qwen3-VL's mean other pixel budgets)."""


def read_video_processor_config(path: str | Path) -> dict[str, Any]:
    """The video processor settings of a model directory, as transformers finds them: ``video_preprocessor_config.json``,
    else ``preprocessor_config.json``; ``min_pixels`` / ``max_pixels`` override ``size`` as in the processor's
    ``__init__``; missing keys take `DEFAULTS`.

    Raises:
        OSError: neither file exists.
        ValueError: the file names a video processor other than `PROCESSOR_TYPES`.
    """
    root = Path(path)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (root / name).is_file():
            raw = json.loads((root / name).read_text())
            break
    else:
        raise OSError(f"{root} has neither video_preprocessor_config.json nor preprocessor_config.json")
    kind = raw.get("video_processor_type")
    if kind is not None and kind not in PROCESSOR_TYPES:
        raise ValueError(
            f"{root / name} is a {kind} config; Qwen2-VL / Qwen2.5-VL videos need one of {list(PROCESSOR_TYPES)}"
        )
    settings = {**DEFAULTS, **{k: v for k, v in raw.items() if k in DEFAULTS}}
    size = dict(settings["size"] or {})
    if raw.get("min_pixels") is not None:
        size["shortest_edge"] = raw["min_pixels"]
    if raw.get("max_pixels") is not None:
        size["longest_edge"] = raw["max_pixels"]
    settings["size"] = size
    return settings


@attrs.frozen
class Qwen2VLVideoRule:
    """The settings of a ``Qwen2VLVideoProcessor`` and the preprocessing steps of the module docstring.

    Attributes:
        fps: the sampling rate (the recipe's ``data.video_fps`` where set, else the processor's where it samples
            frames); None: every frame is kept (upstream's ``do_sample_frames=False``).
        max_frames: the frame cap of sampling, and the most frames a clip may hold when every frame is kept.
        min_pixels, max_pixels: ``size.shortest_edge`` / ``size.longest_edge``, pixels per FRAME.
        resample: ``nearest``, ``bilinear`` or ``bicubic``.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    fps: float | None
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    do_resize: bool
    resample: str
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, fps: float | None = None, max_frames: int | None = None
    ) -> Qwen2VLVideoRule:
        """From the video processor config in ``path`` (`read_video_processor_config`), with the recipe's
        ``data.video_fps`` / ``data.video_max_frames`` where given (a given fps turns frame sampling on).

        Raises:
            OSError: no config file. ValueError: settings this rule does not implement (a fixed ``num_frames``,
                an interpolation other than nearest/bilinear/bicubic, no ``size`` bounds), a non-positive fps, or
                ``max_frames`` below the temporal patch size.
        """
        s = read_video_processor_config(path)
        if s["num_frames"] is not None:
            raise ValueError(
                f"the video processor fixes num_frames={s['num_frames']}; only fps sampling is supported "
                "(set data.video_fps, and cap the frame count with data.video_max_frames)"
            )
        resample = int(s["resample"])
        if resample not in _RESAMPLE:
            raise ValueError(
                f"the video processor's resample={resample} is not supported; expected one of {sorted(_RESAMPLE)} "
                "(PIL codes of nearest, bilinear, bicubic)"
            )
        size = s["size"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(
                f"the video processor's size must hold shortest_edge and longest_edge, found {size}"
            )
        if fps is None and s["do_sample_frames"]:
            if s["fps"] is None:
                raise ValueError("the video processor samples frames (do_sample_frames) but sets no fps")
            fps = s["fps"]
        rule = cls(
            patch_size=int(s["patch_size"]),
            temporal_patch_size=int(s["temporal_patch_size"]),
            merge_size=int(s["merge_size"]),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            fps=None if fps is None else float(fps),
            min_frames=int(s["min_frames"]),
            max_frames=int(s["max_frames"] if max_frames is None else max_frames),
            # Upstream treats None as False (with a warning that the default will change).
            cap_pixels_per_frame=bool(s["cap_pixels_per_frame"]),
            max_video_tokens=int(s["max_video_tokens"]),
            do_resize=bool(s["do_resize"]),
            resample=_RESAMPLE[resample],
            do_rescale=bool(s["do_rescale"]),
            rescale_factor=float(s["rescale_factor"]),
            do_normalize=bool(s["do_normalize"]),
            image_mean=tuple(float(v) for v in s["image_mean"]),
            image_std=tuple(float(v) for v in s["image_std"]),
        )
        if rule.fps is not None and rule.fps <= 0:
            raise ValueError(f"the sampling fps must be > 0, found {rule.fps}")
        if rule.max_frames < rule.temporal_patch_size:
            raise ValueError(
                f"max_frames={rule.max_frames} is below the temporal patch size {rule.temporal_patch_size}: every "
                "clip would be refused"
            )
        return rule

    @property
    def patch_width(self) -> int:
        """Length of one pixel row, ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def sample_indices(self, total_frames: int, source_fps: float) -> np.ndarray:
        """Indices of the frames kept from a video file of ``total_frames`` frames at ``source_fps`` (step 1).

        Returns:
            int64 ``[n]``, ascending.
        Raises:
            ValueError: too few frames for one temporal patch, or (every frame kept) more than ``max_frames``.
        """
        tp = self.temporal_patch_size
        if self.fps is None:
            if total_frames > self.max_frames:
                raise ValueError(
                    f"{total_frames} frames, more than max_frames={self.max_frames} (data.video_max_frames, else the "
                    "video processor's); the video processor samples no frames (do_sample_frames=false), so set "
                    "data.video_fps to sample them"
                )
            return np.arange(total_frames, dtype=np.int64)
        cap = math.floor(min(self.max_frames, total_frames) / tp) * tp
        wanted = min(max(total_frames / source_fps * self.fps, self.min_frames), cap, total_frames)
        n = math.floor(wanted / tp) * tp
        if n < tp:
            raise ValueError(
                f"{total_frames} frame(s) sample to {n}, fewer than the temporal patch size {tp}"
            )
        # Upstream's own arithmetic (a float32 arange truncated to int), so the same frames are picked.
        return torch.arange(0, total_frames, total_frames / n).int().numpy().astype(np.int64)

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """``(H', W')`` of the resized frames of a clip of ``num_frames`` kept frames (step 2)."""
        if not self.do_resize:
            return height, width
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total_pixels * self.temporal_patch_size // num_frames),
                int(self.min_pixels * 1.05),
            )
        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The clip's patch grid ``(t, h, w)`` from the kept frame count and the frame size (no pixels)."""
        resized_h, resized_w = self.resized_size(num_frames, height, width)
        t = -(-num_frames // self.temporal_patch_size)
        return t, resized_h // self.patch_size, resized_w // self.patch_size

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """``<|video_pad|>`` tokens of a clip, ``t * h * w / merge**2`` (step 4)."""
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    def second_per_grid(self, kept_frames: int, total_frames: int, source_fps: float) -> float:
        """Qwen2.5-VL's ``second_per_grid_ts`` of a clip: ``T / sampled_fps``, ``sampled_fps = kept / total * fps``
        (step 4; a frame list keeps all its frames, so its rate is its own)."""
        return self.temporal_patch_size / (kept_frames / total_frames * source_fps)

    def pixel_rows(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Steps 2-3 on the kept frames of one clip.

        Args:
            frames: uint8 ``[n, H, W, 3]`` RGB, all frames of one size.
        Returns:
            ``(rows float32 [t * h * w, 3 * T * P * P], grid (t, h, w))``.
        """
        n, height, width, _ = frames.shape
        return frames_to_rows(frames, self.resized_size(n, height, width), self)


__all__ = ["DEFAULTS", "Qwen2VLVideoRule", "read_video_processor_config"]
