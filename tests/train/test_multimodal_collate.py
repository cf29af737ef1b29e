"""The vision collate table (`veomni.models.multimodal.collate.VISION_COLLATE`) as `collate_multimodal` interprets it,
and as the model consumes it under Ulysses SP on real gloo ranks.

* Keys split by sequence (``position_ids``): every SP rank's slice, concatenated, is the full packed tensor padded
  with ``0, 1, ...`` to the SP-padded length.
* Keys never split or split by the model (grids, pixel rows): every SP rank holds the whole micro-batch's tensor,
  the samples' arrays concatenated, None when no sample has one.
* Pixel rows as the vision tower slices them (`veomni.models.qwen3_vl.sp.slice_patches` on image rows then video
  rows, the table's `RowSplit` group order): the ranks' chunks concatenate back to the rows zero-padded to the
  smallest multiple of ``P * merge**2``, each chunk a whole number of merge groups.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.models.multimodal.collate import VISION_COLLATE as COLLATE
from veomni.models.multimodal.collate import RowSplit, SequenceSplit, TensorRule
from veomni.train.data.encode import Sample
from veomni.train.data.multimodal_batch import MediaSample, collate_multimodal

MERGE, WIDTH = 2, 24


def _grid_rows(draw: st.DrawFn, most: int) -> np.ndarray:
    grids = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)), max_size=most))
    return np.asarray([[t, MERGE * h, MERGE * w] for t, h, w in grids], dtype=np.int64).reshape(-1, 3)


@st.composite
def packed_samples(draw: st.DrawFn) -> list[Sample]:
    """Samples whose pixel rows match their grids (image and video grids drawn per sample)."""
    out, offset = [], 0.0
    for index in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 40))
        image_grids, video_grids = _grid_rows(draw, 2), _grid_rows(draw, 1)
        pixels = []
        for grids in (image_grids, video_grids):
            rows = int(grids.prod(axis=1).sum())
            pixels.append(offset + np.arange(rows * WIDTH, dtype=np.float32).reshape(rows, WIDTH))
            offset += rows * WIDTH
        mrope = np.asarray(draw(st.lists(st.integers(0, 99), min_size=3 * n, max_size=3 * n)), np.int64)
        media = MediaSample(pixels[0], image_grids, mrope.reshape(3, n), pixels[1], video_grids)
        ids = np.asarray(draw(st.lists(st.integers(5, 900), min_size=n, max_size=n)), np.int64)
        trained = np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        out.append(Sample(ids, trained, index, media=media))
    return out


def _concat(samples: list[Sample], key: str) -> torch.Tensor | None:
    arrays = [getattr(s.media, key) for s in samples if len(getattr(s.media, key))]
    return torch.from_numpy(np.concatenate(arrays)) if arrays else None


@settings(max_examples=80, deadline=None)
@given(samples=packed_samples(), sp=st.integers(1, 4))
def test_collate_follows_the_table(samples, sp):
    parts = [collate_multimodal(samples, sp_rank=r, sp_size=sp, pad_id=0) for r in range(sp)]
    length = sum(len(s.input_ids) for s in samples)
    padded = parts[0]["padded_len"]
    assert padded % sp == 0 and padded - length < sp
    # The table names every key the batch carries beyond the text batch.
    assert {r.key for r in COLLATE} <= set(parts[0])
    for rule in COLLATE:
        if isinstance(rule.split, SequenceSplit):
            full = torch.cat([torch.from_numpy(s.media.position_ids) for s in samples], dim=1)
            tail = torch.arange(padded - length).expand(4, -1)
            joined = torch.cat([p[rule.key] for p in parts], dim=2)
            assert joined.shape == (4, 1, padded)
            assert torch.equal(joined[:, 0], torch.cat([full, tail], dim=1))
            continue
        want = _concat(samples, rule.key)
        for part in parts:  # the whole micro-batch's on every rank, never sliced by the collator
            assert (part[rule.key] is None) == (want is None), rule.key
            if want is not None:
                assert torch.equal(part[rule.key], want), rule.key
    assert all(p["num_patches"] == sum(s.media.num_patches for s in samples) for p in parts)
    # Text row of the positions: each sample restarts at 0, exactly the text batch's segments.
    text = torch.cat([p["position_ids"][0, 0] for p in parts])
    assert parts[0]["cu_seqlens"].tolist()[-1] == padded and text[:length].min() == 0


def _tower_chunk(ctx, rows: torch.Tensor, merge_units: int) -> torch.Tensor:
    import torch.distributed as dist

    from veomni.models.qwen3_vl.sp import slice_patches

    return slice_patches(rows, merge_units, dist.group.WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_sp_sliced_pixel_rows_concatenate_back_to_the_padded_rows(dist_pools, world):
    pool = dist_pools.get(world, "gloo")
    split_keys = [r for r in COLLATE if isinstance(r.split, RowSplit)]
    assert [r.key for r in split_keys] == ["pixel_values", "pixel_values_videos"]  # the tower's join order
    rule = split_keys[0].split

    @settings(max_examples=40 // world * 2, deadline=None)
    @given(samples=packed_samples())
    def check(samples):
        batches = [collate_multimodal(samples, sp_rank=r, sp_size=world) for r in range(world)]
        present = [batches[0][r.key] for r in split_keys if batches[0][r.key] is not None]
        if not present:
            return
        rows = torch.cat(present)  # what the model hands its tower: image rows, then video rows
        units = MERGE**rule.merge_power
        chunks = pool.run(_tower_chunk, rows, units)
        multiple = world * units
        padded = -(-rows.shape[0] // multiple) * multiple
        assert all(c.shape == (padded // world, WIDTH) for c in chunks)
        joined = torch.cat(chunks)
        assert torch.equal(joined[: rows.shape[0]], rows)
        assert torch.all(joined[rows.shape[0] :] == rule.pad_value)

    check()


def test_stack_rule_and_empty_keys():
    """A table is data: a stacked per-sample key, and a concatenated key that is None when every sample is empty
    but kept (empty) when the rule says so."""
    table = (
        TensorRule("position_ids", "concat", 1, SequenceSplit("arange"), none_when_empty=False, batch_axis=1),
        TensorRule("flags", "stack", 0, None, none_when_empty=False),
        TensorRule("boxes", "concat", 0, None, none_when_empty=True),
        TensorRule("kept", "concat", 0, None, none_when_empty=False),
    )

    def media(n: int, flag: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            position_ids=np.tile(np.arange(n), (4, 1)),
            flags=np.asarray([flag, -flag]),
            boxes=np.zeros((0, 4)),
            kept=np.zeros((0, 2)),
            num_patches=0,
        )

    samples = [Sample(np.arange(n), np.ones(n, bool), k, media=media(n, k + 1)) for k, n in enumerate((3, 2))]
    batch = collate_multimodal(samples, sp_rank=1, sp_size=2, table=table)
    assert batch["flags"].tolist() == [[1, -1], [2, -2]]
    assert batch["boxes"] is None and batch["kept"].shape == (0, 2)
    assert batch["position_ids"].shape == (4, 1, 3)
    assert batch["position_ids"][0, 0].tolist() == [0, 1, 0]  # second half of [0 1 2 0 1 | pad 0]
    with pytest.raises(ValueError, match="sequence-split key must be concatenated"):
        TensorRule("x", "stack", 0, SequenceSplit(), none_when_empty=False)
