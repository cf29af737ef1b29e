"""Images and videos of multimodal rows: where a part points (a file under ``data.media_root``, inline bytes, or
for a video a list of frame images), its size read from headers alone (for the index), and its decoded RGB pixels
(for training).

Video files are read with PyAV, an optional extra (``pip install veomni-train[video]``); frame lists need nothing
beyond PIL. Every failure is a `DataError` naming the row, the part's place in it and the file: a missing file,
an unreadable or truncated image or video, a relative path without a media root, a missing extra.
"""

from __future__ import annotations

import io
import os
from typing import Any

import attrs
import numpy as np

from veomni.train.data.sources import DataError, RowRef


@attrs.frozen
class ImageRef:
    """One image part of a row: ``path`` (absolute, already joined with the media root) or ``data`` (bytes).

    Attributes:
        row: the row it belongs to (for error messages).
        number: 0-based position among the row's images (or among its video's frames).
        what: how messages name it: ``image``, or ``video V frame`` for a frame of a frame-list video.
    """

    row: RowRef
    number: int
    path: str | None = None
    data: bytes | None = None
    what: str = "image"

    def __str__(self) -> str:
        where = self.path if self.path is not None else f"inline bytes ({len(self.data or b'')} B)"
        return f"{self.row}: {self.what} {self.number} ({where})"


def check_finite_values(values: np.ndarray, what: str, name: str) -> None:
    """Raise a `DataError` naming ``what`` (the row and file) when ``values`` hold NaN or Inf, which would reach
    the loss as a diverged step naming no file; ``name`` says what the values are (``pixel values``, ...)."""
    finite = np.isfinite(values)
    if not finite.all():
        raise DataError(
            f"{what}: {values.size - int(finite.sum())} of its {values.size} {name} are not finite (NaN or Inf); "
            "fix or leave out the file"
        )


def _media_path(value: Any, media_root: str | None, row: RowRef, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise DataError(
            f"{row}: {what} must be a file path (relative to data.media_root) or bytes, found {type(value).__name__}"
        )
    if os.path.isabs(value):
        return value
    if media_root is None:
        raise DataError(f"{row}: {what} has the relative path {value!r} but data.media_root is not set")
    return os.path.join(media_root, value)


def image_ref(value: Any, media_root: str | None, row: RowRef, number: int, what: str = "image") -> ImageRef:
    """The `ImageRef` of an image part's payload: a path string (relative to ``media_root``) or bytes."""
    if isinstance(value, (bytes, bytearray)):
        return ImageRef(row, number, data=bytes(value), what=what)
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):
        return ImageRef(row, number, data=bytes(value["bytes"]), what=what)  # parquet's {bytes, path} struct
    return ImageRef(row, number, path=_media_path(value, media_root, row, f"{what} {number}"), what=what)


def _open(ref: ImageRef) -> Any:
    from PIL import Image, UnidentifiedImageError

    if ref.path is not None and not os.path.isfile(ref.path):
        raise DataError(f"{ref}: no such image file")
    try:
        return Image.open(ref.path if ref.path is not None else io.BytesIO(ref.data or b""))
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataError(f"{ref}: not a readable image ({err})") from None
    except Image.DecompressionBombError as err:  # no OSError: it would escape as a crash naming no row
        raise DataError(
            f"{ref}: not a readable image ({err}; PIL refuses images above 2 x PIL.Image.MAX_IMAGE_PIXELS)"
        ) from None


# EXIF orientations whose upright image is the stored one turned by 90 degrees (height and width swap).
_QUARTER_TURNS = frozenset({5, 6, 7, 8})


def image_size(ref: ImageRef) -> tuple[int, int]:
    """``(height, width)`` of the upright image (`load_image`) from the image header; the pixels are not decoded."""
    from PIL import Image

    with _open(ref) as image:
        width, height = image.size
        try:
            # The base class reads only what the header gave (PNG's override would decode the pixels to look for
            # an EXIF chunk behind them).
            orientation = Image.Image.getexif(image).get(0x0112, 1)
        except (OSError, ValueError, SyntaxError) as err:
            raise DataError(f"{ref}: not a readable image (its EXIF data: {err})") from None
    if orientation in _QUARTER_TURNS:
        width, height = height, width
    if height < 1 or width < 1:
        raise DataError(f"{ref}: the image is empty ({width}x{height})")
    return height, width


def load_image(ref: ImageRef) -> Any:
    """The decoded image as an upright RGB ``PIL.Image`` (a truncated or corrupt body is a `DataError`).

    Upright as transformers' ``load_image`` gives it to the processors: turned by the EXIF orientation tag, which
    cameras set instead of turning the stored pixels.
    """
    from PIL import ImageOps

    image = _open(ref)
    try:
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError) as err:
        raise DataError(f"{ref}: the image data is corrupt or truncated ({err})") from None
    finally:
        image.close()


# ------------------------------------------------------------------------------------------------------- videos


@attrs.frozen
class VideoRef:
    """One video part of a row: a video file (``path``) or a list of frame images (``frames``).

    Attributes:
        number: 0-based position among the row's videos.
        fps: a frame list's rate (the part's ``fps``, else the sampling rate); None for a file (its header's).
    """

    row: RowRef
    number: int
    path: str | None = None
    frames: tuple[ImageRef, ...] = ()
    fps: float | None = None

    def __str__(self) -> str:
        where = self.path if self.path is not None else f"{len(self.frames)} frame images"
        return f"{self.row}: video {self.number} ({where})"


@attrs.frozen
class VideoHeader:
    """What the index needs of a video, read without decoding a frame: frame count, rate and frame size."""

    total_frames: int
    fps: float
    height: int
    width: int


def video_ref(value: Any, media_root: str | None, row: RowRef, number: int, *, fps: float | None) -> VideoRef:
    """The `VideoRef` of a video part's payload: a file path (relative to ``media_root``) or a non-empty list of
    frame images (paths or bytes) taken at ``fps`` frames per second."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise DataError(f"{row}: video {number} is an empty frame list")
        what = f"video {number} frame"
        frames = tuple(image_ref(v, media_root, row, k, what) for k, v in enumerate(value))
        return VideoRef(row, number, frames=frames, fps=fps)
    if not isinstance(value, str) or not value:
        raise DataError(
            f"{row}: video {number} must be a video file path or a list of frame images (paths or bytes), found "
            f"{type(value).__name__}"
        )
    return VideoRef(row, number, path=_media_path(value, media_root, row, f"video {number}"))


def _av(ref: VideoRef) -> Any:
    try:
        import av
    except ImportError:
        raise DataError(
            f"{ref}: reading video files needs PyAV, which is not installed: pip install veomni-train[video] "
            "(or give the video as a list of frame images)"
        ) from None
    return av


def _open_video(ref: VideoRef) -> Any:
    av = _av(ref)
    if not os.path.isfile(ref.path or ""):
        raise DataError(f"{ref}: no such video file")
    try:
        container = av.open(ref.path)
    except (av.FFmpegError, OSError) as err:
        raise DataError(f"{ref}: not a readable video ({err})") from None
    if not container.streams.video:
        container.close()
        raise DataError(f"{ref}: the file holds no video stream")
    return container


def video_header(ref: VideoRef) -> VideoHeader:
    """Frame count, rate and size from the container's headers (a file) or each frame's image header (a list).

    A container without a frame count in its header (Matroska, WebM) has its video packets counted, still without
    decoding a frame. Frames of a list must all have one size.
    """
    if ref.path is None:
        sizes = [image_size(frame) for frame in ref.frames]
        for frame, size in zip(ref.frames, sizes, strict=True):
            if size != sizes[0]:
                raise DataError(
                    f"{frame}: {size[0]}x{size[1]} pixels, but frame 0 of the video is {sizes[0][0]}x{sizes[0][1]}; "
                    "the frames of a video must share one size"
                )
        return VideoHeader(len(sizes), float(ref.fps or 0.0), *sizes[0])
    av = _av(ref)
    with _open_video(ref) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate
        total = int(stream.frames)
        try:
            if total == 0:
                total = sum(1 for packet in container.demux(stream) if packet.size)
        except av.FFmpegError as err:
            raise DataError(f"{ref}: the video data is corrupt ({err})") from None
        height, width = int(stream.height), int(stream.width)
    if not rate or rate <= 0:
        raise DataError(f"{ref}: the video header has no frame rate, so frames cannot be sampled by time")
    if total < 1 or height < 1 or width < 1:
        raise DataError(f"{ref}: the video is empty ({total} frames of {width}x{height})")
    return VideoHeader(total, float(rate), height, width)


def load_video_frames(ref: VideoRef, indices: np.ndarray, header: VideoHeader) -> np.ndarray:
    """The frames at ``indices`` (ascending) decoded to RGB.

    Returns:
        uint8 ``[len(indices), height, width, 3]``.
    Raises:
        DataError: the file decodes to fewer frames than its header promised, or to another frame size.
    """
    picked = [int(i) for i in np.asarray(indices).tolist()]
    if ref.path is None:
        frames = [np.asarray(load_image(ref.frames[i])) for i in picked]
    else:
        av = _av(ref)
        found: dict[int, np.ndarray] = {}
        decoded = 0
        keep, last = set(picked), max(picked)
        with _open_video(ref) as container:
            try:
                for decoded, frame in enumerate(container.decode(container.streams.video[0]), start=1):
                    if decoded - 1 in keep:
                        found[decoded - 1] = frame.to_ndarray(format="rgb24")
                    if decoded - 1 >= last:
                        break
            except av.FFmpegError as err:
                raise DataError(f"{ref}: the video data is corrupt ({err})") from None
        if len(found) < len(keep):
            raise DataError(
                f"{ref}: decoding stopped after {decoded} frames but the header promises {header.total_frames} "
                f"(frame {last} was sampled); the file is truncated or corrupt"
            )
        frames = [found[i] for i in picked]
    for k, frame in zip(picked, frames, strict=True):
        if frame.shape[:2] != (header.height, header.width):
            raise DataError(
                f"{ref}: frame {k} decodes to {frame.shape[0]}x{frame.shape[1]} pixels, but the header says "
                f"{header.height}x{header.width}"
            )
    return np.stack(frames).astype(np.uint8, copy=False)
