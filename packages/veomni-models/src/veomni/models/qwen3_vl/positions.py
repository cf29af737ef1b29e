"""Qwen3-VL's multimodal rotary positions (mrope) for one sample, computed on the host without the model.

Data loaders need the positions before the model sees the batch: under Ulysses SP every rank receives only its
slice of the sequence, and mrope ids cannot be rebuilt from a slice (an image's rows/columns reach back to where
the image started). `Qwen3VLPositions` is the model's rule (transformers 5.23's
``Qwen3VLModel.get_rope_index`` for images) as a small picklable object, so it runs in spawned DataLoader workers:
it holds three integers and no model, config or tokenizer.

The rule, per sample: text tokens advance one position on all three axes; an image of grid ``(t, h, w)`` patches
occupies ``t * (h / m) * (w / m)`` placeholder tokens (``m`` the spatial merge size) whose temporal / height / width
ids are ``start + (frame, row, column)``, and the text after it resumes at ``start + max(h, w) / m``.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np


@attrs.frozen
class Qwen3VLPositions:
    """Picklable mrope position-id function of Qwen3-VL (images; video frames are not produced by this loader).

    Attributes:
        image_token_id: the ``<|image_pad|>`` placeholder id.
        spatial_merge_size: the vision tower's spatial merge size ``m`` (patches per merged token per axis).
    """

    image_token_id: int
    spatial_merge_size: int

    @classmethod
    def from_config(cls, config: Any) -> Qwen3VLPositions:
        """From a ``Qwen3VLConfig`` (``image_token_id`` and ``vision_config.spatial_merge_size``)."""
        return cls(int(config.image_token_id), int(config.vision_config.spatial_merge_size))

    def __call__(self, input_ids: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
        """The ``[t; h; w]`` position ids of one sample.

        Args:
            input_ids: int ``[n]``, the sample with its image placeholders already expanded.
            image_grid_thw: int ``[k, 3]``, the patch grid of each of the sample's k images, in order.
        Returns:
            int64 ``[3, n]``; equal to transformers' ``get_rope_index(...)[0][:, 0]`` for the same sample.
        Raises:
            ValueError: the placeholder runs do not match the grids (count or size).
        """
        ids = np.asarray(input_ids)
        grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
        m = self.spatial_merge_size
        n = len(ids)
        out = np.empty((3, n), dtype=np.int64)
        is_image = ids == self.image_token_id
        edges = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
        starts = np.concatenate([[0], edges]).tolist() if n else []
        ends = np.concatenate([edges, [n]]).tolist() if n else []
        current, used = 0, 0
        for start, end in zip(starts, ends, strict=True):
            if not is_image[start]:
                out[:, start:end] = np.arange(end - start, dtype=np.int64) + current
                current += end - start
                continue
            # One run may hold several images back to back: each takes exactly its grid's token count.
            j = start
            while j < end:
                if used >= len(grids):
                    raise ValueError(
                        f"more image placeholder tokens than the {len(grids)} image grid(s) account for"
                    )
                t, h, w = (int(v) for v in grids[used])
                gh, gw = h // m, w // m
                count = t * gh * gw
                if j + count > end:
                    raise ValueError(
                        f"image {used} has grid {(t, h, w)}, i.e. {count} placeholder tokens, but its run holds "
                        f"only {end - j}"
                    )
                frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
                out[0, j : j + count] = frame.reshape(-1) + current
                out[1, j : j + count] = row.reshape(-1) + current
                out[2, j : j + count] = col.reshape(-1) + current
                current += max(h, w) // m
                j += count
                used += 1
        if used != len(grids):
            raise ValueError(f"{len(grids)} image grid(s) but placeholder tokens for only {used}")
        return out
