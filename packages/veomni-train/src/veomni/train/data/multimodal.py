"""Multimodal conversations (``data.kind: multimodal``): rows of role/content messages whose content is a string
or a list of parts: ``{"type": "text", "text": ...}``, ``{"type": "image", "image": <path or bytes>}`` and
``{"type": "video", "video": <video file path> | [frame image paths or bytes], "fps": <optional, frame lists>}``.

Encoding one row (`MultimodalEncoder`):

1. The chat template renders the messages with one placeholder per image / video part (``<|image_pad|>`` /
   ``<|video_pad|>`` inside ``<|vision_start|> ... <|vision_end|>``, as Qwen-VL templates do); tokens are attributed
   to messages exactly as for ``conversation`` data (`veomni.train.data.encode.ConversationEncoder`).
2. The placeholder counts must equal the image and video counts (both ways; an error names file and row).
3. The model's image processor (``AutoImageProcessor``: the PIL class where torchvision is absent) turns each
   image into ``[patches, C * T * P * P]`` rows and a ``(t, h, w)`` grid; each placeholder is expanded to
   ``t * h * w / merge**2`` tokens, Qwen3-VL processor's own rule (``Qwen3VLProcessor`` itself cannot be built
   without torchvision: it insists on a video processor).
4. Videos follow the model's video rule (its family's `veomni.models.family.DataRules.video_rule`, settings
   from the model's video processor config): a video file is sampled at ``data.video_fps`` (else the processor's fps) up to
   ``data.video_max_frames`` frames; a frame list is used as given, its frames taken ``1 / fps`` seconds apart
   (the part's ``fps``, else the sampling rate), and may hold at most ``video_max_frames`` frames. Each
   ``<|video_pad|>`` becomes, per temporal patch, its timestamp text (the rule's ``timestamp_text``, e.g.
   ``<1.5 seconds>``), ``<|vision_start|>``, its ``<|video_pad|>`` tokens and ``<|vision_end|>``, as Qwen3-VL's
   processor writes it (this encoder is the ``vision`` kind of `veomni.train.data.encoders`).
5. The loss mask is carried through the expansion and inserted tokens are never trained, so the labels are those
   of the expanded sequence. The mrope positions come from the model's position rule (its family's
   ``DataRules.positions``, called with the model config).

The index (`MultimodalEncoder.measure`) gets every row's expanded length without decoding a pixel: image headers
and the processor's resize rule (``get_number_of_image_patches``), video container headers (frame count, rate,
size) and the video rule. The worker checks the real expansion against it (`veomni.train.data.loader`), so the two
can never silently disagree.

The encoded row's media (`MediaSample`) and the collator that packs samples by the model's collate table
(`collate_multimodal`) are in `veomni.train.data.multimodal_batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from veomni.train.data.encode import ConversationEncoder
from veomni.train.data.media import (
    ImageRef,
    VideoRef,
    check_finite_values,
    image_ref,
    image_size,
    load_image,
    load_video_frames,
    video_header,
    video_ref,
)
from veomni.train.data.multimodal_batch import MediaSample, collate_multimodal, empty_rows
from veomni.train.data.row_formats import CONVERSATIONS, MEDIA_COLUMNS, native_row
from veomni.train.data.sources import DataError, RowRef

# collate_multimodal stays importable from here for tools/bench, written against this module.
__all__ = ["MultimodalEncoder", "collate_multimodal", "load_image_processor"]

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def image_token_of(tokenizer: PreTrainedTokenizerBase) -> str:
    """The image placeholder the tokenizer declares (``tokenizer.image_token``), else Qwen-VL's ``<|image_pad|>``."""
    return str(getattr(tokenizer, "image_token", None) or IMAGE_TOKEN)


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
        tokenizer: fast tokenizer with a chat template that renders image parts as ``<|image_pad|>`` and video
            parts as ``<|video_pad|>``.
        image_processor: the model's image processor (``merge_size``, ``get_number_of_image_patches``).
        media_root: directory that relative image and video paths are joined to.
        max_patches: vision patches one micro-batch may hold; a row above it is an error naming it.
        positions: the model's picklable mrope rule, ``positions(ids, image_grid_thw, video_grid_thw)`` -> int64
            ``[3, n]`` (its family's ``DataRules.positions``).
        video_rule: the model's video rule (``sample_indices``, ``grid``, ``timestamps``, ``timestamp_text``,
            ``pixel_rows``, ...; `veomni.train.data.encoders.load_video_rule`), or why there is none: rows with
            videos are then refused with the reason.
        vision_metadata: the model's picklable host-side vision layout (its ``vision_collate_metadata()``, e.g.
            Qwen2.5-VL's window index), run by `collate_multimodal` on each micro-batch's grids; None: none.
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
        positions: Callable[..., np.ndarray],
        video_rule: Any = "no video processor was given",
        vision_metadata: Callable[[torch.Tensor], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(tokenizer, field, loss_mask_field, assistant_only)
        # Every row shape of `veomni.train.data.row_formats` reads from these (parquet: the ones the file has).
        self.columns, self.optional_columns = (), (field, CONVERSATIONS, *MEDIA_COLUMNS)
        self.vision_metadata = vision_metadata
        # The processors read the tokenizer's declared image token (Qwen2.5-Omni's is <|IMAGE|>); <|image_pad|>,
        # the Qwen-VL name, where it declares none.
        self.image_token = image_token_of(tokenizer)
        self.image_token_id = self._token_id(self.image_token, "data.kind is multimodal")
        self.image_processor, self.media_root, self.max_patches = image_processor, media_root, max_patches
        self.merge = int(image_processor.merge_size)
        self.width = 3 * int(image_processor.temporal_patch_size) * int(image_processor.patch_size) ** 2
        # Video support is checked here but refused only when a row holds a video: image data needs none of it.
        self.video_rule: Any = None
        self.video_ids: tuple[int, int, int] | None = None  # (video pad, vision start, vision end)
        self.no_video = video_rule if isinstance(video_rule, str) else ""
        if not isinstance(video_rule, str):
            try:
                ids = tuple(
                    self._token_id(t, "rows hold videos") for t in (VIDEO_TOKEN, VISION_START, VISION_END)
                )
                if (video_rule.merge_size, video_rule.patch_width) != (self.merge, self.width):
                    raise DataError(
                        f"the video processor (merge {video_rule.merge_size}, pixel rows of "
                        f"{video_rule.patch_width}) disagrees with the image processor (merge {self.merge}, pixel "
                        f"rows of {self.width}); both feed one vision tower"
                    )
                self.video_rule, self.video_ids = video_rule, ids
            except DataError as err:
                self.no_video = str(err)
        self.positions = positions
        # Placeholders are counted whenever the tokenizer knows the token, so a stray one is never passed on.
        try:
            self.video_token_id: int | None = self._token_id(VIDEO_TOKEN, "")
        except DataError:
            self.video_token_id = None
        self._timestamps: dict[str, np.ndarray] = {}

    def _token_id(self, token: str, what: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if (
            token_id is None
            or token_id == self.tokenizer.unk_token_id
            or self.tokenizer.convert_ids_to_tokens(token_id) != token
        ):
            raise DataError(f"{what} but the tokenizer has no {token} token")
        return int(token_id)

    extra_parts: tuple[str, ...] = ()  # part types a subclass reads (`_extra_part`), e.g. omni's "audio"

    def _extra_part(self, kind: str, part: dict[str, Any], ref: RowRef) -> None:
        raise NotImplementedError(f"{type(self).__name__} lists {kind!r} in extra_parts but reads none")

    def _parse(
        self, row: dict[str, Any], ref: RowRef
    ) -> tuple[list[dict[str, Any]], list[bool], list[ImageRef], list[VideoRef]]:
        """Messages for the template (media parts without payload), their loss flags, the row's images and
        videos; parts of `extra_parts` go to `_extra_part` (in order) and reach the template without payload.
        LLaVA / ShareGPT and OpenAI-style rows are converted first (`veomni.train.data.row_formats`)."""
        row = native_row(row, self.field, ref)
        messages, flags = self._messages(_text_only(row, self.field), ref)
        raw = row[self.field]
        images: list[ImageRef] = []
        videos: list[VideoRef] = []
        for i, (message, original) in enumerate(zip(messages, raw, strict=True)):
            content = original["content"]
            if isinstance(content, str):
                continue
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in (*self.extra_parts, "image", "video") and kind not in part:
                    raise DataError(f"{ref}: message {i} part {k} is a {kind} part without a {kind!r} field")
                elif kind == "image":
                    images.append(image_ref(part["image"], self.media_root, ref, len(images)))
                    parts.append({"type": "image"})  # the template sees no payload
                elif kind == "video":
                    videos.append(self._video_ref(part, ref, len(videos)))
                    parts.append({"type": "video"})
                elif kind in self.extra_parts:
                    self._extra_part(kind, part, ref)
                    parts.append({"type": kind})
                else:
                    raise DataError(
                        f"{ref}: message {i} part {k} must be {{'type': 'text', 'text': str}}, "
                        f"{{'type': 'image', 'image': path or bytes}} or {{'type': 'video', 'video': path or "
                        f"frame list}}, found {part!r:.80}"
                    )
            message["content"] = parts
        return messages, flags, images, videos

    def _video_ref(self, part: dict[str, Any], ref: RowRef, number: int) -> VideoRef:
        if self.video_rule is None:
            raise DataError(f"{ref}: video {number} cannot be encoded: {self.no_video}")
        fps = part.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0):
            raise DataError(f"{ref}: video {number} has fps={fps!r}; expected a number > 0")
        if fps is not None and not isinstance(part["video"], list | tuple):
            raise DataError(
                f"{ref}: video {number} gives an fps for a video file; a file's rate comes from its header "
                "(fps is for frame lists)"
            )
        value = part["video"]
        return video_ref(value, self.media_root, ref, number, fps=self.video_rule.fps if fps is None else fps)

    def _text(
        self, row: dict[str, Any], ref: RowRef
    ) -> tuple[np.ndarray, np.ndarray, list[ImageRef], list[VideoRef]]:
        messages, flags, images, videos = self._parse(row, ref)
        ids, trained = self._tokens(messages, flags, ref)
        counts = [(self.image_token, self.image_token_id, images, "image")]
        if self.video_token_id is not None:
            counts.append((VIDEO_TOKEN, self.video_token_id, videos, "video"))
        for token, token_id, items, name in counts:
            placeholders = int((ids == token_id).sum())
            if placeholders != len(items):
                raise DataError(
                    f"{ref}: {placeholders} {token} placeholder(s) in the rendered conversation but {len(items)} "
                    f"{name}(s) in the row; they must match one to one"
                )
            trained &= ids != token_id
        return ids, trained, images, videos

    def text_tokens(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, trained)`` of the row's rendered conversation, placeholders not expanded and no media decoded."""
        ids, trained, _, _ = self._text(row, ref)
        return ids, trained

    def _check_patches(
        self, ref: RowRef, patches: Sequence[int], media: Sequence[ImageRef | VideoRef]
    ) -> None:
        if self.max_patches is None:
            return
        for item, count in zip(media, patches, strict=True):
            if count > self.max_patches:
                raise DataError(
                    f"{item}: {count} vision patches after resizing, more than "
                    f"data.patches_per_micro_batch={self.max_patches}"
                )
        if sum(patches) > self.max_patches:
            videos = sum(isinstance(m, VideoRef) for m in media)
            what = f"{len(media) - videos} images" + (f" and {videos} videos" if videos else "")
            raise DataError(
                f"{ref}: {sum(patches)} vision patches over its {what}, more than "
                f"data.patches_per_micro_batch={self.max_patches}"
            )

    def _patches(self, image: ImageRef) -> int:
        try:
            return int(self.image_processor.get_number_of_image_patches(*image_size(image), {}))
        except ValueError as err:  # the resize rule rejects it (aspect ratio above 200, ...)
            if isinstance(err, DataError):
                raise
            raise DataError(f"{image}: the image processor rejects it: {err}") from None

    def _video_plan(self, video: VideoRef) -> tuple[Any, np.ndarray, tuple[int, int, int]]:
        """``(header, sampled frame indices, grid (t, h, w))`` from headers alone."""
        rule = self.video_rule
        assert rule is not None  # _video_ref refused the row otherwise
        header = video_header(video)
        if video.path is not None:
            indices = rule.sample_indices(header.total_frames, header.fps)
        elif header.total_frames > rule.max_frames:
            raise DataError(
                f"{video}: {header.total_frames} frames, more than the {rule.max_frames} a video may hold "
                "(data.video_max_frames, else the video processor's max_frames); a frame list is used as given, "
                "so sample it before"
            )
        else:
            indices = np.arange(header.total_frames)
        try:
            grid = rule.grid(len(indices), header.height, header.width)
        except ValueError as err:
            raise DataError(
                f"{video}: {len(indices)} sampled frames of {header.height}x{header.width}: {err}"
            ) from None
        return header, indices, grid

    def _positions(
        self, ids: np.ndarray, grids: np.ndarray, video_grid_thw: np.ndarray, plans: list[tuple[Any, ...]]
    ) -> np.ndarray:
        """The row's ``[3, n]`` mrope ids; ``plans`` holds ``(video, header, kept indices)`` per clip for rules
        whose positions depend on a clip's timing (`veomni.train.data.untimed_video.UntimedVideoEncoder`)."""
        return self.positions(ids, grids, video_grid_thw)

    def _timestamp_ids(self, text: str) -> np.ndarray:
        if text not in self._timestamps:
            ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            self._timestamps[text] = np.asarray(ids, dtype=np.int64)
        return self._timestamps[text]

    def _video_tokens(self, grid: tuple[int, int, int], indices: np.ndarray, fps: float) -> np.ndarray:
        """What one ``<|video_pad|>`` expands to: per temporal patch, its timestamp text, ``<|vision_start|>``,
        its video tokens and ``<|vision_end|>``."""
        assert self.video_rule is not None and self.video_ids is not None
        video_id, start, end = self.video_ids
        per_patch = np.full(self.video_rule.tokens_per_temporal_patch(grid), video_id, dtype=np.int64)
        pieces = []
        for seconds in self.video_rule.timestamps(indices, fps):
            pieces += [
                self._timestamp_ids(self.video_rule.timestamp_text(seconds)),
                np.asarray([start]),
                per_patch,
                np.asarray([end]),
            ]
        return np.concatenate(pieces).astype(np.int64)

    def measure(self, row: dict[str, Any], ref: RowRef) -> tuple[int, int, int]:
        """``(tokens, trained tokens, vision patches)`` of the expanded row, from image and video headers only."""
        ids, trained, images, videos = self._text(row, ref)
        patches = [self._patches(image) for image in images]
        extra = sum(p // self.merge**2 - 1 for p in patches)
        for video in videos:
            header, indices, grid = self._video_plan(video)
            patches.append(int(np.prod(grid)))
            extra += len(self._video_tokens(grid, indices, header.fps)) - 1
        self._check_patches(ref, patches, [*images, *videos])
        return len(ids) + extra, int(trained.sum()), sum(patches)

    def _image_rows(self, ref: RowRef, images: list[ImageRef]) -> tuple[np.ndarray, np.ndarray]:
        if not images:
            return empty_rows(self.width)
        try:
            out = self.image_processor(images=[load_image(i) for i in images], return_tensors="np")
        except DataError:
            raise
        except Exception as err:  # the processor rejects odd images (aspect ratio > 200, ...)
            raise DataError(f"{ref}: the image processor failed: {err}") from None
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        names = ", ".join(i.path or f"inline bytes ({len(i.data or b'')} B)" for i in images)
        check_finite_values(pixels, f"{ref}: the images ({names})", "pixel values")
        return pixels, np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray, MediaSample]:
        ids, trained, images, videos = self._text(row, ref)
        pixels, grids = self._image_rows(ref, images)
        image_blocks = [np.full(int(g.prod()) // self.merge**2, self.image_token_id, np.int64) for g in grids]
        video_pixels, video_grids, video_blocks, plans = [], [], [], []
        for video in videos:
            header, indices, grid = self._video_plan(video)
            plans.append((video, header, indices))
            assert self.video_rule is not None
            rows, got = self.video_rule.pixel_rows(load_video_frames(video, indices, header))
            check_finite_values(np.asarray(rows), str(video), "pixel values")
            if got != grid:  # the plan and the processing share one rule; a mismatch is a bug, not bad data
                raise RuntimeError(f"{video}: processed grid {got} differs from the planned grid {grid}")
            video_pixels.append(rows)
            video_grids.append(grid)
            video_blocks.append(self._video_tokens(grid, indices, header.fps))
        patches = [int(g.prod()) for g in grids] + [int(np.prod(g)) for g in video_grids]
        self._check_patches(ref, patches, [*images, *videos])
        replacements = list(
            zip(np.flatnonzero(ids == self.image_token_id).tolist(), image_blocks, strict=True)
        )
        if self.video_ids is not None:
            where = np.flatnonzero(ids == self.video_ids[0]).tolist()
            replacements += list(zip(where, video_blocks, strict=True))
        ids, trained = _expand(ids, trained, sorted(replacements, key=lambda r: r[0]))
        video_grid_thw = np.asarray(video_grids, dtype=np.int64).reshape(-1, 3)
        try:
            mrope = self._positions(ids, grids, video_grid_thw, plans)
        except ValueError as err:
            raise DataError(f"{ref}: {err}") from None
        video_rows = np.concatenate(video_pixels) if video_pixels else empty_rows(self.width)[0]
        return ids, trained, MediaSample(pixels, grids, mrope, video_rows, video_grid_thw)


def _expand(
    ids: np.ndarray, trained: np.ndarray, replacements: list[tuple[int, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Replace the placeholder at each ``(position, block)`` (ascending positions) by ``block``, untrained."""
    out_ids, out_trained, previous = [], [], 0
    for position, block in replacements:
        out_ids += [ids[previous:position], block]
        out_trained += [trained[previous:position], np.zeros(len(block), dtype=bool)]
        previous = position + 1
    out_ids.append(ids[previous:])
    out_trained.append(trained[previous:])
    return np.concatenate(out_ids).astype(np.int64), np.concatenate(out_trained)


def _text_only(row: dict[str, Any], field: str) -> dict[str, Any]:
    """``row`` with list contents replaced by "" so the conversation checks of the base class apply."""
    raw = row.get(field)
    if not isinstance(raw, list):
        return row
    messages = [
        {**m, "content": ""} if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in raw
    ]
    return {**row, field: messages}
