"""Multimodal conversations (``data.kind: multimodal``): rows of role/content messages whose content is a string
or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": <path or bytes>}`` parts.

Encoding one row (`MultimodalEncoder`):

1. The chat template renders the messages with one image placeholder per image part (``<|image_pad|>`` inside
   ``<|vision_start|> ... <|vision_end|>`` for Qwen3-VL); tokens are attributed to messages exactly as for
   ``conversation`` data (`veomni.train.data.encode.ConversationEncoder`).
2. The placeholder count must equal the image count (both ways; an error names file and row).
3. The model's image processor (``AutoImageProcessor``: the PIL class where torchvision is absent) turns each
   image into ``[patches, C * T * P * P]`` rows and a ``(t, h, w)`` grid; each placeholder is expanded to
   ``t * h * w / merge**2`` tokens, Qwen3-VL processor's own rule (``Qwen3VLProcessor`` itself cannot be built
   without torchvision: it insists on a video processor). The loss mask is carried through the expansion and
   image tokens are never trained, so the labels are those of the expanded sequence.
4. The mrope positions of the expanded sample come from the model's position function
   (`veomni.models.qwen3_vl.positions.Qwen3VLPositions`).

The index (`MultimodalEncoder.measure`) gets every row's expanded length without decoding a pixel: the image
header's size and the processor's resize rule (``get_number_of_image_patches``). The worker checks the real
expansion against it (`veomni.train.data.loader`), so the two can never silently disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from veomni.core.sp.padding import slice_for_rank
from veomni.models.qwen3_vl.positions import Qwen3VLPositions
from veomni.train.data.encode import ConversationEncoder, Sample
from veomni.train.data.media import ImageRef, image_ref, image_size, load_image
from veomni.train.data.packing import _finish, shifted_labels
from veomni.train.data.sources import DataError, RowRef

IMAGE_TOKEN = "<|image_pad|>"


@attrs.frozen(eq=False)
class MediaSample:
    """The vision side of one encoded row.

    Attributes:
        pixel_values: float32 ``[patches, C * T * P * P]`` (``[0, D]`` for a row without images).
        image_grid_thw: int64 ``[k, 3]``, one ``(t, h, w)`` patch grid per image.
        mrope: int64 ``[3, n]``, the sample's ``[t; h; w]`` position ids (from 0).
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    mrope: np.ndarray

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])


def load_image_processor(path: str) -> Any:
    """``AutoImageProcessor.from_pretrained(path)`` (transformers picks the PIL class without torchvision)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise DataError(
            f"data.kind is multimodal but {path} holds no loadable image processor (preprocessor_config.json): {err}"
        ) from None


class MultimodalEncoder(ConversationEncoder):
    """Encodes multimodal conversations (module docstring); ``measure`` is the index's pixel-free variant.

    Args:
        tokenizer: fast tokenizer with a chat template that renders image parts as ``<|image_pad|>``.
        image_processor: the model's image processor (``merge_size``, ``get_number_of_image_patches``).
        media_root: directory that relative image paths are joined to.
        max_patches: vision patches one micro-batch may hold; a row above it is an error naming it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Any,
        field: str,
        loss_mask_field: str | None,
        assistant_only: bool,
        *,
        media_root: str | None,
        max_patches: int | None,
    ) -> None:
        super().__init__(tokenizer, field, loss_mask_field, assistant_only)
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if (
            image_id is None
            or image_id == tokenizer.unk_token_id
            or tokenizer.convert_ids_to_tokens(image_id) != IMAGE_TOKEN
        ):
            raise DataError(f"data.kind is multimodal but the tokenizer has no {IMAGE_TOKEN} token")
        self.image_processor, self.media_root, self.max_patches = image_processor, media_root, max_patches
        self.image_token_id = int(image_id)
        self.merge = int(image_processor.merge_size)
        self.positions = Qwen3VLPositions(self.image_token_id, self.merge)

    def _parse(
        self, row: dict[str, Any], ref: RowRef
    ) -> tuple[list[dict[str, Any]], list[bool], list[ImageRef]]:
        """Messages for the template (image parts without payload), their loss flags, and the row's images."""
        messages, flags = self._messages(_text_only(row, self.field), ref)
        raw = row[self.field]
        images: list[ImageRef] = []
        for i, (message, original) in enumerate(zip(messages, raw, strict=True)):
            content = original["content"]
            if isinstance(content, str):
                continue
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image":
                    if "image" not in part:
                        raise DataError(
                            f"{ref}: message {i} part {k} is an image part without an 'image' field"
                        )
                    images.append(image_ref(part["image"], self.media_root, ref, len(images)))
                    parts.append({"type": "image"})  # the template sees no payload
                else:
                    raise DataError(
                        f"{ref}: message {i} part {k} must be {{'type': 'text', 'text': str}} or "
                        f"{{'type': 'image', 'image': path or bytes}}, found {part!r:.80}"
                    )
            message["content"] = parts
        return messages, flags, images

    def _text(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray, list[ImageRef]]:
        messages, flags, images = self._parse(row, ref)
        ids, trained = self._tokens(messages, flags, ref)
        placeholders = int((ids == self.image_token_id).sum())
        if placeholders != len(images):
            raise DataError(
                f"{ref}: {placeholders} {IMAGE_TOKEN} placeholder(s) in the rendered conversation but {len(images)} "
                "image(s) in the row; they must match one to one"
            )
        trained &= ids != self.image_token_id
        return ids, trained, images

    def _check_patches(self, ref: RowRef, patches: Sequence[int], images: Sequence[ImageRef]) -> None:
        if self.max_patches is None:
            return
        for image, count in zip(images, patches, strict=True):
            if count > self.max_patches:
                raise DataError(
                    f"{image}: {count} vision patches after resizing, more than "
                    f"data.patches_per_micro_batch={self.max_patches}"
                )
        if sum(patches) > self.max_patches:
            raise DataError(
                f"{ref}: {sum(patches)} vision patches over its {len(images)} images, more than "
                f"data.patches_per_micro_batch={self.max_patches}"
            )

    def _patches(self, image: ImageRef) -> int:
        try:
            return int(self.image_processor.get_number_of_image_patches(*image_size(image), {}))
        except ValueError as err:  # the resize rule rejects it (aspect ratio above 200, ...)
            if isinstance(err, DataError):
                raise
            raise DataError(f"{image}: the image processor rejects it: {err}") from None

    def measure(self, row: dict[str, Any], ref: RowRef) -> tuple[int, int, int]:
        """``(tokens, trained tokens, vision patches)`` of the expanded row, from image headers only."""
        ids, trained, images = self._text(row, ref)
        patches = [self._patches(image) for image in images]
        self._check_patches(ref, patches, images)
        extra = sum(p // self.merge**2 - 1 for p in patches)
        return len(ids) + extra, int(trained.sum()), sum(patches)

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray, MediaSample]:
        ids, trained, images = self._text(row, ref)
        if images:
            try:
                out = self.image_processor(images=[load_image(i) for i in images], return_tensors="np")
            except DataError:
                raise
            except Exception as err:  # the processor rejects odd images (aspect ratio > 200, ...)
                raise DataError(f"{ref}: the image processor failed: {err}") from None
            pixels = np.asarray(out["pixel_values"], dtype=np.float32)
            grids = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        else:
            width = (
                3 * int(self.image_processor.temporal_patch_size) * int(self.image_processor.patch_size) ** 2
            )
            pixels, grids = np.zeros((0, width), dtype=np.float32), np.zeros((0, 3), dtype=np.int64)
        self._check_patches(ref, [int(g.prod()) for g in grids], images)
        counts = np.ones(len(ids), dtype=np.int64)
        counts[ids == self.image_token_id] = grids.prod(axis=1) // self.merge**2
        ids, trained = np.repeat(ids, counts), np.repeat(trained, counts)
        try:
            mrope = self.positions(ids, grids)
        except ValueError as err:
            raise DataError(f"{ref}: {err}") from None
        return ids, trained, MediaSample(pixels, grids, mrope)


def _text_only(row: dict[str, Any], field: str) -> dict[str, Any]:
    """``row`` with list contents replaced by "" so the conversation checks of the base class apply."""
    raw = row.get(field)
    if not isinstance(raw, list):
        return row
    messages = [
        {**m, "content": ""} if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in raw
    ]
    return {**row, field: messages}


def collate_multimodal(
    samples: Sequence[Sample], *, sp_rank: int = 0, sp_size: int = 1, pad_id: int = 0
) -> dict[str, Any]:
    """Pack multimodal samples into one row: the text batch of `veomni.train.data.packing.collate`, plus

    * ``position_ids`` int64 ``[4, 1, S]``: ``[text; t; h; w]`` (transformers 5.23's 4-row mrope layout), each
      packed sample restarting at 0, the SP padding ``0, 1, ...`` on all rows; this rank's slice of the full row;
    * ``pixel_values`` float32 ``[patches, D]`` (all samples' rows concatenated) and ``image_grid_thw`` int64
      ``[images, 3]`` stacked, both NOT sliced under SP (the model slices the tower's input itself); None when
      the micro-batch holds no image;
    * ``num_patches`` int.
    """
    if not samples or any(s.media is None for s in samples):
        raise ValueError("collate_multimodal needs at least one sample, each with media")
    input_ids = torch.from_numpy(np.concatenate([s.input_ids for s in samples]).astype(np.int64))
    labels = torch.from_numpy(np.concatenate([shifted_labels(s.input_ids, s.trained) for s in samples]))
    text = np.concatenate([np.arange(len(s.input_ids), dtype=np.int64) for s in samples])
    positions = torch.from_numpy(
        np.concatenate([text[None], np.concatenate([s.media.mrope for s in samples], 1)])
    )
    batch = _finish(input_ids, labels, positions[0], sp_rank, sp_size, pad_id)
    pad = batch["padded_len"] - batch["seq_len"]
    if pad:
        positions = torch.cat([positions, torch.arange(pad, dtype=torch.int64).expand(4, -1)], dim=1)
    batch["position_ids"] = slice_for_rank(positions, 1, sp_rank, sp_size).unsqueeze(1).contiguous()
    pixels = [s.media.pixel_values for s in samples if s.media.num_patches]
    batch["pixel_values"] = torch.from_numpy(np.concatenate(pixels)) if pixels else None
    grids = [s.media.image_grid_thw for s in samples if len(s.media.image_grid_thw)]
    batch["image_grid_thw"] = torch.from_numpy(np.concatenate(grids)) if grids else None
    batch["num_patches"] = sum(s.media.num_patches for s in samples)
    batch["sample_index"] = [s.index for s in samples]
    return batch


def multimodal_padding_batch(*, sp_rank: int = 0, sp_size: int = 1, pad_id: int = 0) -> dict[str, Any]:
    """The one-token filler batch of evaluation (`veomni.train.data.packing.padding_batch`) in multimodal form."""
    media = MediaSample(np.zeros((0, 1), np.float32), np.zeros((0, 3), np.int64), np.zeros((3, 1), np.int64))
    sample = Sample(np.asarray([pad_id], np.int64), np.zeros(1, bool), -1, media=media)
    batch = collate_multimodal([sample], sp_rank=sp_rank, sp_size=sp_size, pad_id=pad_id)
    batch["sample_index"], batch["is_padding"] = [], True
    return batch
