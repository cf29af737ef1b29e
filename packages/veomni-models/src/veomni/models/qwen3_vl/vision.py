"""Hand-written pieces of the Qwen3-VL adapter that the generated modeling file calls.

Vision geometry without host syncs (upstream's helpers loop over ``grid_thw.tolist()`` and size tensors from
device values), the inputs of the tower's dummy forward, the scatter of visual features into the text
embeddings without data-dependent shapes, and the LM head + loss of the conditional-generation model.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.vision_utils import _interpolation_axis_taps_weights

from veomni.core.parallel_state import current_parallel_state_or_none
from veomni.models.qwen3_vl.sp import visual_index


def patch_coordinates(
    grid_thw: torch.Tensor, merge: int, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row, column, grid height and grid width of every patch, in the tower's spatial-merge-block order.

    The order is upstream's: per image/clip, per frame, blocks of ``merge x merge`` patches row-major, and
    row-major inside a block. Every size is known on the host (``total`` is the number of pixel rows), so
    nothing waits for the device.

    Args:
        grid_thw: ``[n, 3]`` integer ``(t, h, w)`` per image/clip (h, w multiples of ``merge``).
        merge: the spatial merge size.
        total: ``sum(t * h * w)``, i.e. ``pixel_values.shape[0]``.
    Returns:
        four int64 ``[total]`` tensors on ``grid_thw``'s device.
    """
    grid = grid_thw.to(torch.int64)
    counts = grid.prod(-1)
    heights = torch.repeat_interleave(grid[:, 1], counts, output_size=total)
    widths = torch.repeat_interleave(grid[:, 2], counts, output_size=total)
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)
    # Index inside one frame (frames of a clip repeat the same spatial layout).
    within = (torch.arange(total, device=grid.device) - starts) % (heights * widths)
    blocks_per_row = widths // merge
    block, inner = within // (merge * merge), within % (merge * merge)
    row = (block // blocks_per_row) * merge + inner // merge
    col = (block % blocks_per_row) * merge + inner % merge
    return row, col, heights, widths


def vision_geometry(
    grid_thw: torch.Tensor, merge: int, num_grid_per_side: int, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tower's rotary positions and learned-position interpolation taps, computed without host syncs.

    Equal to upstream's ``get_vision_position_ids`` and ``get_vision_interpolation_indices_and_weights``
    (bilinear, ``align_corners=True``), which size their outputs from device values.

    Returns:
        ``(position_ids int64 [total, 2] (row, col), interp_indices int64 [total, 4], interp_weights fp32
        [total, 4])``.
    """
    row, col, heights, widths = patch_coordinates(grid_thw, merge, total)
    side = num_grid_per_side
    h_taps, h_weights = _interpolation_axis_taps_weights(row, heights, side, "bilinear", True)
    w_taps, w_weights = _interpolation_axis_taps_weights(col, widths, side, "bilinear", True)
    n = h_taps.shape[1]
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, n * n)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, n * n)
    return torch.stack([row, col], dim=-1), indices, weights


def dummy_vision_inputs(config: Any, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest valid tower input: one frame of ``merge x merge`` patches (one merged token), zeros.

    Shapes come from the vision config, dtype and device from a live weight of the tower (under FSDP2 a
    sharded parameter still reports them), so nothing is cached across calls or models.

    Returns:
        ``(pixel_values [merge**2, C * T_patch * P * P] in weight's dtype, grid_thw int64 [1, 3])``.
    """
    merge = config.spatial_merge_size
    row = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.zeros(merge * merge, row, dtype=weight.dtype, device=weight.device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.int64, device=weight.device)
    return pixels, grid


def parallel_world_size() -> int:
    """World size of the current veomni parallel state (1 outside ``use_parallel_state``)."""
    state = current_parallel_state_or_none()
    return 1 if state is None else state.dims.world_size


def scatter_visual(
    inputs_embeds: torch.Tensor, masks: list[torch.Tensor], features: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put each modality's features, in order, at its placeholder positions (like HF's ``masked_scatter``).

    Done as a gather + ``where`` over the whole sequence so that no tensor has a data-dependent size (no host
    sync), and so that the deepstack layers can add their features the same way.

    Args:
        inputs_embeds: ``[B, S, H]``.
        masks: per modality, bool ``[B, S]`` placeholder positions (disjoint).
        features: per modality, ``[N_m, H]`` in sequence order; ``N_m`` must equal the mask's count (checked by
            the caller, as HF does).
    Returns:
        ``(embeds [B, S, H], visual mask bool [B, S], gather index int64 [B * S])``: the index maps each
        position to its row in ``torch.cat(features)`` (0 at non-visual positions).
    """
    visual, index = visual_index(masks, [f.shape[0] for f in features])
    index = index.reshape(-1)
    joined = torch.cat(features, dim=0).to(inputs_embeds.device, inputs_embeds.dtype)
    gathered = joined.index_select(0, index).reshape(inputs_embeds.shape)
    return torch.where(visual[..., None], gathered, inputs_embeds), visual, index
