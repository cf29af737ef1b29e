"""Qwen2.5-VL's windowed ViT attention, laid out on the host.

Most blocks of Qwen2.5-VL's vision tower attend inside square windows of ``window_size`` pixels; the tower first
reorders the merged tokens (groups of ``merge x merge`` patches) window by window, so every window is one contiguous
``cu_window_seqlens`` segment, and undoes the order after the merger. transformers computes that order inside every
forward with a ``grid_thw.tolist()`` loop (``transformers.vision_utils.get_vision_window_index``); `WindowIndex` is
the same rule as a small picklable object that the collator runs once per micro-batch in the DataLoader worker, so
the forward receives the order and the segment table ready-made and never waits for the device.

The rule, per image/clip of grid ``(t, h, w)`` patches and ``m = spatial_merge_size``: the merged grid is
``(h / m) x (w / m)`` per frame; windows are ``v x v`` merged tokens with ``v = window_size / (m * patch_size)``,
tiled from the top-left corner (the right and bottom windows may be smaller); windows are taken frame by frame,
row-major, and the tokens inside a window row-major. Each window is a segment of ``count * m**2`` patch rows.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from veomni.models.qwen2_vl.vision import FrameSegments


@attrs.frozen
class WindowIndex:
    """Picklable window layout of Qwen2.5-VL's vision tower (also the vision tower's segment table).

    Attributes:
        spatial_merge_size: patches per merged token along each axis (``m``).
        window_size: window side in pixels; a multiple of ``m * patch_size``.
        patch_size: pixels per patch side.
    """

    spatial_merge_size: int
    window_size: int
    patch_size: int

    def __attrs_post_init__(self) -> None:
        unit = self.spatial_merge_size * self.patch_size
        if self.window_size <= 0 or self.window_size % unit:
            raise ValueError(
                f"Qwen2.5-VL window_size must be a positive multiple of spatial_merge_size * patch_size = "
                f"{self.spatial_merge_size} * {self.patch_size} = {unit} pixels (one merged token), so that "
                f"windows hold whole merged tokens; found window_size={self.window_size}"
            )

    @classmethod
    def from_config(cls, vision_config: Any) -> WindowIndex:
        """From a ``Qwen2_5_VLVisionConfig`` (``spatial_merge_size``, ``window_size``, ``patch_size``)."""
        return cls(
            int(vision_config.spatial_merge_size),
            int(vision_config.window_size),
            int(vision_config.patch_size),
        )

    @property
    def merged_window(self) -> int:
        """Window side in merged tokens (``v``)."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    def __call__(self, grid_thw: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """The tower's segment tables for the images/clips of ``grid_thw``, in the order the tower runs them.

        Args:
            grid_thw: int ``[n, 3]`` ``(t, h, w)`` patches per image/clip (h, w multiples of the merge size).
        Returns:
            ``window_index`` int64 ``[sum(t * h * w) / m**2]`` (the merged-token order, windows contiguous),
            ``cu_window_seqlens`` int32 ``[windows + 1]`` (patch-row boundaries of the windows, in that order),
            ``max_window_seqlen`` int, ``cu_seqlens`` int32 ``[sum(t) + 1]`` (one segment per frame, the
            full-attention blocks' table) and ``max_seqlen`` int; the names are the keyword arguments the vision
            tower reads (``transformers.vision_utils``).
        Raises:
            ValueError: a grid that is not ``[n, 3]`` or whose h or w is not a multiple of the merge size.
        """
        grids = np.asarray(grid_thw.cpu() if isinstance(grid_thw, torch.Tensor) else grid_thw, dtype=np.int64)
        if grids.ndim != 2 or grids.shape[1] != 3:
            raise ValueError(f"grid_thw must be [n, 3] (t, h, w) per image/clip; found shape {grids.shape}")
        m, v = self.spatial_merge_size, self.merged_window
        orders, windows = [], []
        offset = 0
        for t, h, w in grids.tolist():
            if h % m or w % m or min(t, h, w) <= 0:
                raise ValueError(
                    f"grid (t, h, w) = {(t, h, w)}: h and w must be positive multiples of spatial_merge_size={m}"
                )
            gh, gw = h // m, w // m
            across = -(-gw // v)  # windows per row of windows
            window_of = ((np.arange(gh)[:, None] // v) * across + np.arange(gw)[None, :] // v).reshape(-1)
            # A stable sort by window id keeps the row-major order of the tokens inside each window.
            order = np.argsort(window_of, kind="stable")
            counts = np.bincount(window_of)
            per_frame = gh * gw
            orders.append((order[None, :] + offset + per_frame * np.arange(t)[:, None]).reshape(-1))
            windows.append(np.tile(counts, t))
            offset += t * per_frame
        window_rows = np.concatenate(windows) * m * m if windows else np.zeros(0, np.int64)
        return {
            "window_index": torch.from_numpy(np.concatenate(orders) if orders else np.zeros(0, np.int64)),
            "cu_window_seqlens": torch.from_numpy(
                np.concatenate([[0], np.cumsum(window_rows)]).astype(np.int32)
            ),
            "max_window_seqlen": int(window_rows.max(initial=0)),
            **FrameSegments()(grids),  # the full-attention blocks' per-frame table
        }


__all__ = ["WindowIndex"]
