"""Images of multimodal rows: where an image part points (a file under ``data.media_root`` or inline bytes), its
size read from the header alone (for the index), and its decoded RGB pixels (for training).

Every failure is a `DataError` naming the row, the image's place in it and the file: a missing file, an
unreadable or truncated image, a relative path without a media root.
"""

from __future__ import annotations

import io
import os
from typing import Any

import attrs

from veomni.train.data.sources import DataError, RowRef


@attrs.frozen
class ImageRef:
    """One image part of a row: ``path`` (absolute, already joined with the media root) or ``data`` (bytes).

    Attributes:
        row: the row it belongs to (for error messages).
        number: 0-based position among the row's images.
    """

    row: RowRef
    number: int
    path: str | None = None
    data: bytes | None = None

    def __str__(self) -> str:
        where = self.path if self.path is not None else f"inline bytes ({len(self.data or b'')} B)"
        return f"{self.row}: image {self.number} ({where})"


def image_ref(value: Any, media_root: str | None, row: RowRef, number: int) -> ImageRef:
    """The `ImageRef` of an image part's payload: a path string (relative to ``media_root``) or bytes."""
    if isinstance(value, (bytes, bytearray)):
        return ImageRef(row, number, data=bytes(value))
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):
        return ImageRef(row, number, data=bytes(value["bytes"]))  # parquet's usual {bytes, path} struct
    if not isinstance(value, str) or not value:
        raise DataError(
            f"{row}: image {number} must be a file path (relative to data.media_root) or bytes, found "
            f"{type(value).__name__}"
        )
    if os.path.isabs(value):
        return ImageRef(row, number, path=value)
    if media_root is None:
        raise DataError(
            f"{row}: image {number} has the relative path {value!r} but data.media_root is not set"
        )
    return ImageRef(row, number, path=os.path.join(media_root, value))


def _open(ref: ImageRef) -> Any:
    from PIL import Image, UnidentifiedImageError

    if ref.path is not None and not os.path.isfile(ref.path):
        raise DataError(f"{ref}: no such image file")
    try:
        return Image.open(ref.path if ref.path is not None else io.BytesIO(ref.data or b""))
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataError(f"{ref}: not a readable image ({err})") from None


def image_size(ref: ImageRef) -> tuple[int, int]:
    """``(height, width)`` from the image header; the pixels are not decoded."""
    with _open(ref) as image:
        width, height = image.size
    if height < 1 or width < 1:
        raise DataError(f"{ref}: the image is empty ({width}x{height})")
    return height, width


def load_image(ref: ImageRef) -> Any:
    """The decoded image as an RGB ``PIL.Image`` (a truncated or corrupt body is a `DataError`)."""
    image = _open(ref)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as err:
        raise DataError(f"{ref}: the image data is corrupt or truncated ({err})") from None
    finally:
        image.close()
