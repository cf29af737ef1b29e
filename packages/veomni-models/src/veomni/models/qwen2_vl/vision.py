"""Hand-written pieces of the Qwen2-VL / Qwen2.5-VL adapters that their generated modeling files call.

The two families share everything but the vision tower's windows: the tower's rotary positions without host syncs,
the patch-row permutation of the windowed tower, and the composite model's visual step (one tower pass over all
images and videos, features placed without data-dependent shapes, a dummy tower pass on ranks without media, the
Ulysses SP scatter). The SP and scatter primitives are Qwen3-VL's (`veomni.models.qwen3_vl.sp`,
`veomni.models.qwen3_vl.vision`): the placeholder and patch-row layouts are the same.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch
from torch import nn

from veomni.models.qwen3_vl.sp import scatter_visual_sp, sp_group_or_none
from veomni.models.qwen3_vl.vision import parallel_world_size, patch_coordinates, scatter_visual


@attrs.frozen
class FrameSegments:
    """Picklable per-frame segment table of the Qwen2-VL-family vision towers (every frame of every image/clip
    attends within itself), run by the trainer's collator on each micro-batch's joint image-then-video grids so
    that the tower never reads ``grid_thw`` back from the device (transformers' ``get_vision_cu_seqlens``)."""

    def __call__(self, grid_thw: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """``cu_seqlens`` int32 ``[sum(t) + 1]`` (patch-row boundaries, one segment of ``h * w`` rows per frame)
        and ``max_seqlen`` int, for int ``[n, 3]`` ``(t, h, w)`` grids; the keyword names the towers read."""
        grids = np.asarray(grid_thw.cpu() if isinstance(grid_thw, torch.Tensor) else grid_thw, dtype=np.int64)
        if grids.ndim != 2 or grids.shape[1] != 3:
            raise ValueError(f"grid_thw must be [n, 3] (t, h, w) per image/clip; found shape {grids.shape}")
        rows = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
        cu = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        return {"cu_seqlens": torch.from_numpy(cu), "max_seqlen": int(rows.max(initial=0))}


def vision_position_ids(grid_thw: torch.Tensor, merge: int, total: int) -> torch.Tensor:
    """The tower's rotary ``(row, column)`` of every patch, in the tower's spatial-merge-block order.

    Equal to transformers' ``get_vision_position_ids(grid_thw, merge)``, computed without ``.tolist()``.

    Args:
        grid_thw: int ``[n, 3]`` ``(t, h, w)`` per image/clip; ``total``: ``sum(t * h * w)`` (pixel rows).
    Returns:
        int64 ``[total, 2]`` on ``grid_thw``'s device.
    """
    row, col, _, _ = patch_coordinates(grid_thw, merge, total)
    return torch.stack([row, col], dim=-1)


def permute_rows(rows: torch.Tensor, window_index: torch.Tensor, units: int) -> torch.Tensor:
    """Reorder per-patch rows by merged token: group ``k`` of ``units`` consecutive rows moves to where
    ``window_index`` names it (upstream's ``permute_input_for_window_attn``).

    Args:
        rows: ``[N, ...]`` with N a multiple of ``units`` (``spatial_merge_size**2``).
        window_index: int64 ``[N / units]``, a permutation.
    Returns:
        ``[N, ...]``, same dtype.
    """
    grouped = rows.reshape(rows.shape[0] // units, units, *rows.shape[1:])
    return grouped[window_index.to(rows.device)].reshape(rows.shape)


def embed_visual(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor,
    media: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
    mm_encoder_outputs: dict[str, Any] | None,
    vision_metadata: dict[str, Any] | None,
) -> torch.Tensor:
    """The text embeddings with every image and video feature at its placeholders.

    The tower runs once over all images then clips of the micro-batch (frames attend only within themselves, so
    this equals separate passes); a rank without any media under a parallel world > 1 runs the tower's
    ``dummy_forward`` and adds its 0-valued result, so FSDP's collectives match across ranks. Under Ulysses SP
    ``inputs_embeds`` is this rank's slice and the features land in its token range.

    Args:
        model: the ``Qwen2VLModel`` / ``Qwen2_5_VLModel`` (``visual``, ``get_placeholder_mask``).
        input_ids: int ``[B, S]`` (None: placeholders are found from the embeddings, as upstream).
        inputs_embeds: ``[B, S, H]``.
        media: ``{"image": (pixel_values [p, D], image_grid_thw [k, 3]), "video": (...)}``; None where absent.
        mm_encoder_outputs: precomputed tower outputs per modality (upstream's per-image ``pooler_output``).
        vision_metadata: the tower's precomputed segment tables for the joint image+video grids (the
            collator's, e.g. `veomni.models.qwen2_5_vl.window.WindowIndex`), passed to the tower as keywords.
    Returns:
        ``[B, S, H]`` embeddings.
    """
    for modality, (pixels, grid) in media.items():
        if pixels is not None and grid is None:
            raise ValueError(
                f"{modality} pixel rows were given without their grid_thw ([n, 3] (t, h, w) each)"
            )
    if mm_encoder_outputs and any(p is not None for p, _ in media.values()):
        raise ValueError("You cannot specify both pixel_values/pixel_values_videos and mm_encoder_outputs")
    features: dict[str, torch.Tensor] = {}
    for modality, given in (mm_encoder_outputs or {}).items():
        if given is not None:
            features[modality] = torch.cat(given.pooler_output, dim=0)
    runs = [(m, p, g) for m, (p, g) in media.items() if p is not None]
    if runs:
        pixels = torch.cat([p for _, p, _ in runs], dim=0).type(model.visual.dtype)
        grids = torch.cat([g for _, _, g in runs], dim=0)
        out = model.visual(pixels, grid_thw=grids, return_dict=True, **dict(vision_metadata or {}))
        merge = model.visual.spatial_merge_size**2
        start = 0
        for modality, p, _ in runs:
            stop = start + p.shape[0] // merge
            features[modality] = out.pooler_output[start:stop]
            start = stop
    elif not features and parallel_world_size() > 1:
        inputs_embeds = inputs_embeds + model.visual.dummy_forward().to(inputs_embeds.dtype)
    if not features:
        return inputs_embeds

    sp_group = sp_group_or_none()
    checked = sp_group is None  # under SP the counts are checked over the full sequence (scatter_visual_sp)
    image_mask, video_mask = model.get_placeholder_mask(
        input_ids,
        inputs_embeds=inputs_embeds,
        image_features=features.get("image") if checked else None,
        video_features=features.get("video") if checked else None,
    )
    masks = {"image": image_mask[..., 0], "video": video_mask[..., 0]}
    order = [m for m in ("image", "video") if m in features]
    local_masks, feats = [masks[m] for m in order], [features[m] for m in order]
    if sp_group is None:
        return scatter_visual(inputs_embeds, local_masks, feats)[0]
    return scatter_visual_sp(inputs_embeds, local_masks, feats, sp_group)[0]


__all__ = ["FrameSegments", "embed_visual", "permute_rows", "vision_position_ids"]
