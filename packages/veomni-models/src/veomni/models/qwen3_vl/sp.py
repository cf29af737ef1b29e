"""Ulysses sequence parallelism (SP) for Qwen3-VL: the vision tower's patch slicing and the visual-token scatter.

Contract under SP (current parallel state with ``sp = P > 1``):

* Every SP rank receives the *full* ``pixel_values`` / ``pixel_values_videos`` and ``*_grid_thw`` of the
  micro-batch (the SP ranks of one group share it) and slices the pixel rows itself (`slice_patches`), so the
  collator needs no vision-specific rule and the tower sees exactly the rows it would see unsliced. Rows are
  zero-padded to a multiple of ``P * merge**2``, so each rank holds whole spatial-merge groups and the
  merger's ``view(-1, hidden * merge**2)`` never mixes rows of two ranks.
* The tower attends through `veomni.models.hf.encoder_attention.encoder_attention` with the SP group and the
  full ``cu_seqlens`` plus one entry for the tail padding, which thus attends only to itself (``sp_unpadded_len``
  cannot be used: `veomni.core.sp.ulysses_attention` then returns ``ceil(N / sp)``-row shards, not the
  ``sp * merge**2``-padded ones), and its merged tokens and
  deepstack features are all-gathered once (`gather_merged`), so the tower's outputs are the full features,
  the same on every rank, as without SP.
* The language model's ``input_ids``, ``position_ids`` (the 3- or 4-row mrope ids, which cannot be rebuilt from a
  slice) and labels are this rank's contiguous slice of the sequence padded to a multiple of P
  (`veomni.core.sp.slice_sequence`). The placeholder masks of the full sequence are all-gathered (small int
  tensors), the visual features are placed at the full sequence's placeholder positions and each rank keeps its
  own token range (`scatter_visual_sp`); deepstack features are cut to the same range.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from veomni.core.parallel_state import current_parallel_state_or_none
from veomni.core.sp import gather_sequence, pad_and_slice, slice_for_rank
from veomni.models.hf.attention import PREFIX


def sp_group_or_none() -> dist.ProcessGroup | None:
    """The SP group of the current veomni parallel state, or None without one or with ``sp == 1``."""
    state = current_parallel_state_or_none()
    if state is None or state.dims.sp == 1:
        return None
    return state.sp_group


def sp_world_size(group: dist.ProcessGroup) -> int:
    """Number of ranks in the SP ``group``."""
    return dist.get_world_size(group)


def check_sp_inputs(
    config, position_ids: torch.Tensor | None, embeds: torch.Tensor, group: dist.ProcessGroup
) -> None:
    """Refuse, with what was expected and what was found, inputs that cannot run under Ulysses SP.

    Args:
        config: the composite VLM config (Qwen3-VL, Qwen3-VL-MoE, Qwen2-VL, Qwen2.5-VL; named in the errors).
        position_ids: must be this rank's slice of the mrope ids, ``[3 or 4, B, S_local]`` int.
        embeds: this rank's ``[B, S_local, H]`` input embeddings.
    """
    world = dist.get_world_size(group)
    if position_ids is None:
        raise ValueError(
            f"{config.model_type} under sequence parallelism (sp={world}) needs position_ids: the multimodal rope ids "
            "([3 or 4, batch, local_seq_len], this rank's slice of the ids computed on the full sequence by "
            "the model's position-id function) cannot be rebuilt from a sequence slice; got None"
        )
    batch, local = embeds.shape[:2]
    expected = (batch, local)
    if (
        position_ids.dim() != 3
        or position_ids.shape[0] not in (3, 4)
        or tuple(position_ids.shape[1:]) != expected
    ):
        raise ValueError(
            f"{config.model_type} under sequence parallelism (sp={world}) expects position_ids of shape [3 or 4, {batch}, "
            f"{local}] (mrope rows, batch, this rank's sequence slice); got {tuple(position_ids.shape)}"
        )
    implementation = config.text_config._attn_implementation or ""
    if not implementation.startswith(PREFIX):
        raise ValueError(
            f"{config.model_type} under sequence parallelism (sp={world}) needs a veomni attention implementation in the "
            f"language model (veomni_sdpa, veomni_eager, ...; they run the Ulysses all-to-all); got "
            f"{implementation!r}"
        )
    heads = config.vision_config.num_heads
    if heads % world:
        raise ValueError(
            f"{config.model_type} vision tower under sequence parallelism: its {heads} attention heads must be divisible "
            f"by sp={world}"
        )


def slice_patches(rows: torch.Tensor, merge_units: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of per-patch rows, zero-padded to a multiple of ``P * merge_units`` first.

    The same rule slices pixel rows, rotary positions and learned-position taps, so they stay aligned.

    Args:
        rows: ``[N, ...]`` identical on every SP rank (N = total patches of the micro-batch), any dtype.
        merge_units: ``spatial_merge_size ** 2`` (rows merged into one visual token).
    Returns:
        ``[ceil(N / (P * merge_units)) * merge_units, ...]``.
    """
    return pad_and_slice(rows, 0, group, pad_value=0, pad_scale=merge_units)


def gather_merged(local: torch.Tensor, total: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather the merged visual tokens of every rank's patch chunk and drop the padding's tokens.

    Backward sums each rank's gradient over the group (every rank reads the whole result).

    Args:
        local: ``[N_pad / (P * merge**2), D]`` this rank's merged tokens.
        total: the true number of merged tokens, ``N / merge**2``.
    Returns:
        ``[total, D]``, identical on every rank.
    """
    return gather_sequence(local, group, dim=0, equal_sizes=True)[:total]


def visual_index(masks: list[torch.Tensor], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each position's visual feature is in ``torch.cat(features)``, for disjoint per-modality masks.

    Args:
        masks: per modality, bool ``[B, S]`` placeholder positions; ``counts``: that modality's feature rows.
    Returns:
        ``(visual bool [B, S], index int64 [B, S])``; index is 0 at non-visual positions.
    """
    offset = 0
    index = torch.zeros(masks[0].shape, dtype=torch.int64, device=masks[0].device)
    visual = torch.zeros_like(index, dtype=torch.bool)
    for mask, count in zip(masks, counts, strict=True):
        rank = mask.reshape(-1).long().cumsum(0).reshape(mask.shape) - 1 + offset
        index = torch.where(mask, rank, index)
        visual = visual | mask
        offset += count
    return visual, index


def scatter_visual_sp(
    inputs_embeds: torch.Tensor,
    local_masks: list[torch.Tensor],
    features: list[torch.Tensor],
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place the full visual features at the full sequence's placeholders and keep this rank's token range.

    The masks of the whole (padded) sequence are gathered from every rank (one small all-gather), the feature
    index is computed over the whole sequence, and only this rank's columns are applied to its embeddings, so
    a rank whose slice has no placeholder gets its text embeddings unchanged (its features still join autograd
    and the gathers' backward collectives, like its peers').

    Args:
        inputs_embeds: ``[B, S_local, H]`` this rank's embeddings.
        local_masks: per modality, bool ``[B, S_local]`` placeholders of this rank's slice.
        features: per modality, ``[N_m, H]`` all of the micro-batch's features in sequence order.
    Returns:
        ``(embeds [B, S_local, H], visual mask bool [B, S_local], index int64 [B * S_local])``: the index maps
        each local position to its row in ``torch.cat(features)`` (0 at non-visual positions).
    """
    stacked = torch.stack([m.to(torch.int64) for m in local_masks])  # gloo cannot gather bool tensors
    full = gather_sequence(stacked, group, dim=2, equal_sizes=True).bool()  # [M, B, P * S_local]
    for mask, feats in zip(full, features, strict=True):
        found = int(mask.sum())
        if found != feats.shape[0]:
            raise ValueError(
                f"visual features and placeholder tokens do not match over the full sequence: {found} "
                f"placeholder tokens, {feats.shape[0]} feature rows"
            )
    visual, index = visual_index(list(full), [f.shape[0] for f in features])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    visual = slice_for_rank(visual, 1, rank, world)
    index = slice_for_rank(index, 1, rank, world).reshape(-1)
    joined = torch.cat(features, dim=0).to(inputs_embeds.device, inputs_embeds.dtype)
    gathered = joined.index_select(0, index).reshape(inputs_embeds.shape)
    return torch.where(visual[..., None], gathered, inputs_embeds), visual, index


__all__ = [
    "check_sp_inputs",
    "gather_merged",
    "scatter_visual_sp",
    "slice_patches",
    "sp_group_or_none",
    "sp_world_size",
    "visual_index",
]
