"""Tiny Qwen3-VL configs and batches shared by the Qwen3-VL adapter tests (built from configs, nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import Qwen3VLConfig

IMAGE, VIDEO, START, END = 100, 101, 102, 103
VOCAB = 128


def tiny_config(deepstack: tuple[int, ...] = (0, 1)) -> Qwen3VLConfig:
    """2 text layers, a 2-block ViT with deepstack, interleaved mrope; untied LM head."""
    return Qwen3VLConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
            "deepstack_visual_indexes": list(deepstack),
        },
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False,
    )  # fmt: skip


def vlm_batch(
    rows: list[list[tuple[str, tuple[int, int, int]]]], seed: int = 0, length: int | None = None
) -> dict[str, torch.Tensor]:
    """Rows of text with image / video placeholder runs; ``rows[i]`` lists ``(kind, (t, h, w))`` per item.

    Every row is right-padded with text tokens to the same length; labels are the ids (no ignored tokens except
    placeholders, as a chat collator would mask them).
    """
    gen = torch.Generator().manual_seed(seed)
    ids_rows, pixels, grids = [], {"image": [], "video": []}, {"image": [], "video": []}
    for items in rows:
        ids: list[int] = []
        for kind, (t, h, w) in items:
            ids += torch.randint(0, 90, (2,), generator=gen).tolist()
            if kind == "image":
                ids += [START] + [IMAGE] * (h * w // 4) + [END]
            else:
                # Qwen3-VL separates a clip's frames with a timestamp: one placeholder run per frame.
                for _ in range(t):
                    ids += [int(torch.randint(0, 90, (1,), generator=gen))] + [START] + [VIDEO] * (h * w // 4) + [END]
            pixels[kind].append(torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=gen))
            grids[kind].append((t, h, w))
        ids += torch.randint(0, 90, (3,), generator=gen).tolist()
        ids_rows.append(ids)
    width = max(len(r) for r in ids_rows) if length is None else length
    ids_rows = [r + torch.randint(0, 90, (width - len(r),), generator=gen).tolist() for r in ids_rows]
    input_ids = torch.tensor(ids_rows)
    labels = input_ids.masked_fill((input_ids == IMAGE) | (input_ids == VIDEO), -100)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long(),
    }
    if pixels["image"]:
        batch["pixel_values"] = torch.cat(pixels["image"])
        batch["image_grid_thw"] = torch.tensor(grids["image"])
    if pixels["video"]:
        batch["pixel_values_videos"] = torch.cat(pixels["video"])
        batch["video_grid_thw"] = torch.tensor(grids["video"])
    return batch


IMAGES = [[("image", (1, 4, 4)), ("image", (1, 2, 6))], [("image", (1, 2, 2))]]
MIXED = [[("image", (1, 4, 4)), ("video", (2, 2, 4))], [("video", (2, 2, 2)), ("image", (1, 2, 2))]]
