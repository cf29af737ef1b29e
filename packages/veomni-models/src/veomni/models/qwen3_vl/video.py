"""Qwen3-VL's video preprocessing rule, without torchvision.

transformers' ``Qwen3VLVideoProcessor`` resizes through torchvision, which this framework does not require, so
the rule is restated here from transformers 5.23 (``video_processing_qwen3_vl.py`` and the video half of
``processing_qwen3_vl.py``), step by step:

1. **Frame sampling** (``sample_frames``): a clip of ``N`` frames at ``F`` fps keeps
   ``n = min(max(int(N / F * fps), min_frames), max_frames, N)`` frames at ``linspace(0, N - 1, n).round()``.
2. **Resize** (``smart_resize``, the video variant): every frame to one ``(H', W')``, multiples of
   ``patch * merge``, with ``n * H' * W'`` kept inside ``[min_pixels, max_pixels]`` (``size.shortest_edge`` /
   ``size.longest_edge``; ``cap_pixels_per_frame`` lowers the ceiling as upstream does). The interpolation is
   torchvision's CPU path for uint8 frames, i.e. ``torch.nn.functional.interpolate`` with ``antialias=True``.
3. **Rescale + normalise** fused as upstream: ``(x - mean / r) / (std / r)`` in float32 (``r`` the rescale factor).
4. **Patchify**: the frame count is padded to a multiple of ``temporal_patch_size`` by repeating the last frame;
   grid ``(n' / T, H' / P, W' / P)``; rows ordered per temporal patch, per ``merge x merge`` block, row-major.
5. **Placeholders**: each temporal patch ``k`` becomes ``<{s_k:.1f} seconds><|vision_start|>`` +
   ``(H' / P) * (W' / P) / merge**2`` ``<|video_pad|>`` + ``<|vision_end|>``, where ``s_k`` is the mean time of
   the patch's first and last frame (sampled index / source fps; the index list padded like the frames). The
   processor replaces the template's ``<|video_pad|>`` with that text, so the template's own
   ``<|vision_start|>``/``<|vision_end|>`` stay around it.

`Qwen3VLVideoRule` holds the processor's settings as plain values (picklable into spawned DataLoader workers);
tests compare every step that upstream can run without torchvision against upstream's own functions.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch

# PIL resample codes (what processor configs store) -> torch interpolation modes.
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Upstream's video ``smart_resize``: the ``(height, width)`` every frame of the clip is resized to.

    Raises:
        ValueError: fewer frames than ``temporal_factor``, or an aspect ratio above 200.
    """
    if num_frames < temporal_factor:
        raise ValueError(f"{num_frames} frame(s), fewer than the temporal patch size {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamp_text(seconds: float) -> str:
    """The text Qwen3-VL's processor writes before a temporal patch's tokens, e.g. ``<1.5 seconds>``."""
    return f"<{seconds:.1f} seconds>"


@attrs.frozen
class Qwen3VLVideoRule:
    """The settings of a ``Qwen3VLVideoProcessor`` and the preprocessing steps of the module docstring.

    Attributes:
        fps, max_frames: the sampling rate and frame cap (the recipe's ``data.video_fps`` /
            ``data.video_max_frames`` where set, else the processor's).
        min_pixels, max_pixels: ``size.shortest_edge`` / ``size.longest_edge`` (pixels over all frames).
        resample: ``nearest``, ``bilinear`` or ``bicubic``.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    fps: float
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
    def from_processor(
        cls, processor: Any, *, fps: float | None = None, max_frames: int | None = None
    ) -> Qwen3VLVideoRule:
        """From a loaded ``Qwen3VLVideoProcessor`` (its class runs without torchvision; only ``__call__`` needs it).

        Raises:
            ValueError: settings this rule does not implement (a fixed ``num_frames``, no frame sampling, an
                interpolation other than nearest/bilinear/bicubic), or ``max_frames`` below the temporal patch size.
        """
        if getattr(processor, "num_frames", None) is not None:
            raise ValueError(
                f"the video processor fixes num_frames={processor.num_frames}; only fps sampling is supported "
                "(cap the frame count with data.video_max_frames)"
            )
        if not getattr(processor, "do_sample_frames", True):
            raise ValueError("the video processor has do_sample_frames=false; only fps sampling is supported")
        resample = int(processor.resample)
        if resample not in _RESAMPLE:
            raise ValueError(
                f"the video processor's resample={resample} is not supported; expected one of {sorted(_RESAMPLE)} "
                "(PIL codes of nearest, bilinear, bicubic)"
            )
        size = processor.size
        rule = cls(
            patch_size=int(processor.patch_size),
            temporal_patch_size=int(processor.temporal_patch_size),
            merge_size=int(processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            fps=float(processor.fps if fps is None else fps),
            min_frames=int(processor.min_frames),
            max_frames=int(processor.max_frames if max_frames is None else max_frames),
            # Upstream treats None as False (with a warning that the default will change).
            cap_pixels_per_frame=bool(processor.cap_pixels_per_frame),
            max_video_tokens=int(processor.max_video_tokens),
            do_resize=bool(processor.do_resize),
            resample=_RESAMPLE[resample],
            do_rescale=bool(processor.do_rescale),
            rescale_factor=float(processor.rescale_factor),
            do_normalize=bool(processor.do_normalize),
            image_mean=tuple(float(v) for v in processor.image_mean),
            image_std=tuple(float(v) for v in processor.image_std),
        )
        if rule.max_frames < rule.temporal_patch_size:
            raise ValueError(
                f"max_frames={rule.max_frames} is below the temporal patch size {rule.temporal_patch_size}: every "
                "clip would be refused"
            )
        if rule.fps <= 0:
            raise ValueError(f"the sampling fps must be > 0, found {rule.fps}")
        return rule

    @property
    def patch_width(self) -> int:
        """Length of one pixel row, ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def sample_indices(self, total_frames: int, source_fps: float) -> np.ndarray:
        """Indices of the frames kept from a clip of ``total_frames`` frames at ``source_fps`` (step 1).

        Returns:
            int64 ``[n]``, ascending, ``n <= total_frames`` (a clip shorter than ``min_frames`` keeps every frame).
        """
        n = int(total_frames / source_fps * self.fps)
        n = min(max(n, self.min_frames), self.max_frames, total_frames)
        return np.linspace(0, total_frames - 1, n).round().astype(np.int64)

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """``(H', W')`` of the resized frames of a clip of ``num_frames`` sampled frames (step 2)."""
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        if not self.do_resize:
            if num_frames < self.temporal_patch_size:
                raise ValueError(
                    f"{num_frames} frame(s), fewer than the temporal patch size {self.temporal_patch_size}"
                )
            return height, width
        return smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=self.temporal_patch_size,
            factor=factor,
            min_pixels=self.min_pixels,
            max_pixels=max_pixels,
        )

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The clip's patch grid ``(t, h, w)`` from the sampled frame count and the frame size (no pixels)."""
        resized_h, resized_w = self.resized_size(num_frames, height, width)
        t = -(-num_frames // self.temporal_patch_size)
        return t, resized_h // self.patch_size, resized_w // self.patch_size

    def timestamps(self, indices: np.ndarray, source_fps: float) -> list[float]:
        """Seconds of each temporal patch: the mean of its first and last frame's time (step 5)."""
        times = [int(i) / source_fps for i in np.asarray(indices).tolist()]
        tps = self.temporal_patch_size
        times += [times[-1]] * (-len(times) % tps)
        return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]

    @staticmethod
    def timestamp_text(seconds: float) -> str:
        """The text written before a temporal patch's tokens (module-level `timestamp_text`; the data pipeline
        reaches it through the rule, not by this module's name)."""
        return timestamp_text(seconds)

    def tokens_per_temporal_patch(self, grid: tuple[int, int, int]) -> int:
        """``<|video_pad|>`` tokens of one temporal patch, ``h * w / merge**2``."""
        return grid[1] * grid[2] // self.merge_size**2

    def pixel_rows(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Steps 2-4 on the sampled frames of one clip.

        Args:
            frames: uint8 ``[n, H, W, 3]`` RGB, all frames of one size.
        Returns:
            ``(rows float32 [t * h * w, 3 * T * P * P], grid (t, h, w))``.
        """
        n, height, width, _ = frames.shape
        return frames_to_rows(frames, self.resized_size(n, height, width), self)


def patchify(
    video: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Upstream's ``patchify`` for one clip (step 4).

    Args:
        video: float32 ``[n, C, H, W]``, H and W multiples of ``patch_size * merge_size``.
    Returns:
        ``(rows float32 [t * h * w, C * T * P * P], (t, h, w))``.
    """
    n, channels, height, width = video.shape
    if pad := -n % temporal_patch_size:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        n += pad
    t, h, w = n // temporal_patch_size, height // patch_size, width // patch_size
    m, p, tp = merge_size, patch_size, temporal_patch_size
    patches = video.reshape(t, tp, channels, h // m, m, p, w // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(t * h * w, channels * tp * p * p), dtype=np.float32), (
        t,
        h,
        w,
    )


def frames_to_rows(
    frames: np.ndarray, size: tuple[int, int], settings: Any
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resize (step 2), rescale + normalise (step 3) and patchify (step 4) one clip's sampled frames; shared by the
    Qwen2-VL and Qwen3-VL video rules, whose processors differ only in how they pick frames and ``size``.

    Args:
        frames: uint8 ``[n, H, W, 3]`` RGB, all frames of one size.
        size: ``(H', W')`` to resize to (no resize where equal to ``(H, W)``).
        settings: the rule (``resample``, ``do_rescale``, ``rescale_factor``, ``do_normalize``, ``image_mean``,
            ``image_std``, ``patch_size``, ``merge_size``, ``temporal_patch_size``).
    Returns:
        ``(rows float32 [t * h * w, 3 * T * P * P], grid (t, h, w))``.
    """
    _, height, width, _ = frames.shape
    resized_h, resized_w = size
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [n, 3, H, W]
    if (resized_h, resized_w) != (height, width):
        # torchvision resizes uint8 frames natively on CPU for bicubic (the processor's default) and nearest;
        # bilinear goes through float32 here (torchvision's native uint8 bilinear needs AVX2, else the same).
        native = settings.resample in ("bicubic", "nearest")
        x = video.contiguous() if native else video.float()
        x = torch.nn.functional.interpolate(
            x,
            size=(resized_h, resized_w),
            mode=settings.resample,
            align_corners=None if settings.resample == "nearest" else False,
            antialias=settings.resample != "nearest",
        )
        video = x if native else x.clamp(0, 255).round().to(torch.uint8)
    pixels = video.to(torch.float32)
    mean, std = torch.tensor(settings.image_mean), torch.tensor(settings.image_std)
    if settings.do_rescale and settings.do_normalize:
        # Fused as upstream: (x - mean / r) / (std / r).
        mean, std = mean * (1.0 / settings.rescale_factor), std * (1.0 / settings.rescale_factor)
        pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    elif settings.do_normalize:
        pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    elif settings.do_rescale:
        pixels = pixels * settings.rescale_factor
    return patchify(pixels.numpy(), settings.patch_size, settings.merge_size, settings.temporal_patch_size)
