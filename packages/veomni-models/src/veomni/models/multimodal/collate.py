"""The vision-language collate table: for each tensor a multimodal micro-batch carries beside the text batch, how
the samples' arrays are packed, whether and how the result is split under Ulysses SP, and how it is padded.

The collator (`veomni.train.data.multimodal_batch.collate_multimodal`) interprets `VISION_COLLATE` and holds no
per-key code; the models consume exactly what the table describes (every Qwen-VL-style tower: Qwen3-VL's SP
handling is `veomni.models.qwen3_vl.sp`). The keys are the models' forward arguments of the same names:

==================== ================= ==================== ======================================================
key                  one sample        packed               under SP (P ranks)
==================== ================= ==================== ======================================================
position_ids         int64 [4, n]      [4, 1, L] (tokens)   sliced by the collator like ``input_ids``; padding
                                                            ``0, 1, ...`` on every row (a segment of its own)
pixel_values         float32 [p, D]    [sum p, D]           every rank gets all rows; the vision tower joins image
pixel_values_videos  float32 [q, D]    [sum q, D]           then video rows, zero-pads them to a multiple of
                                                            ``P * merge**2`` and keeps its equal chunk
image_grid_thw       int64 [k, 3]      [sum k, 3]           never sliced (the tower needs every grid)
video_grid_thw       int64 [v, 3]      [sum v, 3]           never sliced
==================== ================= ==================== ======================================================

Pixel rows and grids are None when no sample of the micro-batch has that modality (the model then runs its dummy
tower forward where collectives need one). The placeholder masks are never sent: the model derives them from
``input_ids`` and gathers the full sequence's masks itself.
"""

from __future__ import annotations

from typing import Literal

import attrs


@attrs.frozen
class SequenceSplit:
    """Split by the collator along the token axis exactly like ``input_ids``: padded to the SP-padded length,
    then this rank's contiguous chunk.

    Attributes:
        pad: ``"arange"`` (``0, 1, ...`` on every row, so the padding is one attention segment of its own) or a
            constant fill value.
    """

    pad: Literal["arange"] | int = "arange"


@attrs.frozen
class RowSplit:
    """Rows of vision patches: not split by the collator (every SP rank receives all of them); the vision tower
    concatenates the rows of every key of ``group`` in table order, pads them with ``pad_value`` to a multiple
    of ``P * spatial_merge_size**merge_power`` and keeps its equal chunk, so no merge group straddles two ranks.
    """

    group: str = "vision"
    merge_power: int = 2
    pad_value: float = 0.0


@attrs.frozen
class TensorRule:
    """How one key of the batch is built from the samples' arrays of the same name.

    Attributes:
        key: the batch key, also the attribute of each sample's media that holds its array.
        pack: ``concat`` the samples' arrays along ``dim`` or ``stack`` them on a new axis ``dim``.
        split: `SequenceSplit`, `RowSplit`, or None (never split: the whole micro-batch's on every SP rank).
        none_when_empty: the batch holds None when no sample has rows (size 0 along ``dim``).
        batch_axis: where a batch axis of size 1 is inserted after packing and splitting (None: none).
    """

    key: str
    pack: Literal["concat", "stack"]
    dim: int
    split: SequenceSplit | RowSplit | None
    none_when_empty: bool
    batch_axis: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.pack not in ("concat", "stack"):
            raise ValueError(f"{self.key}: pack must be concat or stack, found {self.pack!r}")
        if isinstance(self.split, SequenceSplit) and self.pack != "concat":
            raise ValueError(f"{self.key}: a sequence-split key must be concatenated along its token axis")


VISION_COLLATE: tuple[TensorRule, ...] = (
    TensorRule("position_ids", "concat", 1, SequenceSplit("arange"), none_when_empty=False, batch_axis=1),
    TensorRule("pixel_values", "concat", 0, RowSplit(), none_when_empty=True),
    TensorRule("image_grid_thw", "concat", 0, None, none_when_empty=True),
    TensorRule("pixel_values_videos", "concat", 0, RowSplit(), none_when_empty=True),
    TensorRule("video_grid_thw", "concat", 0, None, none_when_empty=True),
)
"""The table (module docstring); the vision keys are the models' forward arguments of the same names."""


def model_keys(table: tuple[TensorRule, ...] = VISION_COLLATE) -> tuple[str, ...]:
    """The table's keys in order (each is a keyword argument of the model's forward)."""
    return tuple(rule.key for rule in table)


__all__ = ["VISION_COLLATE", "RowSplit", "SequenceSplit", "TensorRule", "model_keys"]
