"""Packing properties: unpack(collate) is the identity, no label crosses a sample, SP slices cover every token once,
cu_seqlens match the samples, and a packed forward equals per-sample forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import random_sample
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.train.data import (
    IGNORE_INDEX,
    collate,
    model_inputs,
    pack_rows,
    padding_batch,
    shifted_labels,
    unpack,
)


@st.composite
def sample_lists(draw: st.DrawFn, max_samples: int = 8, max_len: int = 40) -> list:
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_samples))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [random_sample(rng, 100 + i, n) for i, n in enumerate(lengths)]


@settings(max_examples=200)
@given(samples=sample_lists())
def test_unpack_inverts_collate(samples):
    batch = collate(samples)
    restored = unpack(batch)
    assert len(restored) == len(samples)
    for (ids, trained), s in zip(restored, samples, strict=True):
        assert np.array_equal(ids, s.input_ids) and np.array_equal(trained, s.trained)
    assert batch["sample_index"] == [s.index for s in samples]


@settings(max_examples=200)
@given(samples=sample_lists())
def test_no_label_crosses_a_sample_boundary(samples):
    batch = collate(samples)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    ends = np.cumsum([len(s.input_ids) for s in samples]) - 1
    assert (labels[ends] == IGNORE_INDEX).all()  # each sample's last position predicts nothing
    valid = (labels != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(labels[valid], ids[valid + 1])  # a valid label is the next token ...
    segment = torch.bucketize(torch.arange(ids.numel()), batch["cu_seqlens"][1:].long(), right=True)
    assert torch.equal(segment[valid], segment[valid + 1])  # ... of the same sample
    assert int(batch["num_valid_tokens"]) == sum(s.num_trained for s in samples)


@settings(max_examples=200)
@given(samples=sample_lists())
def test_positions_and_cu_seqlens(samples):
    batch = collate(samples)
    lengths = [len(s.input_ids) for s in samples]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, *np.cumsum(lengths).tolist()]
    assert batch["max_seqlen"] == max(lengths)
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    assert batch["seq_len"] == batch["padded_len"] == sum(lengths)
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].shape == (1, sum(lengths)) and batch[key].dtype == torch.int64


@settings(max_examples=150)
@given(samples=sample_lists(), sp=st.integers(2, 5), pad_id=st.integers(0, 5))
def test_sp_slices_cover_every_token_once(samples, sp, pad_id):
    full = collate(samples, pad_id=pad_id)
    parts = [collate(samples, sp_rank=r, sp_size=sp, pad_id=pad_id) for r in range(sp)]
    length = full["seq_len"]
    padded = -(-length // sp) * sp
    pad = padded - length
    for key, fill in (
        ("input_ids", [pad_id] * pad),
        ("labels", [IGNORE_INDEX] * pad),
        ("position_ids", list(range(pad))),
    ):
        joined = torch.cat([p[key] for p in parts], dim=1)[0].tolist()
        assert joined == full[key][0].tolist() + fill, key
        assert all(p[key].shape == (1, padded // sp) for p in parts)
    # Every rank gets the full-row metadata; the SP padding is one segment of its own.
    expected_cu = full["cu_seqlens"].tolist() + ([padded] if pad else [])
    for p in parts:
        assert p["cu_seqlens"].tolist() == expected_cu
        assert p["max_seqlen"] == max(full["max_seqlen"], pad) and (p["seq_len"], p["padded_len"]) == (
            length,
            padded,
        )
    assert sum(int(p["num_valid_tokens"]) for p in parts) == int(full["num_valid_tokens"])


@settings(max_examples=200)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=60),
    budget=st.integers(50, 200),
    seed=st.integers(0, 1000),
)
def test_pack_rows_respects_the_budget_and_takes_every_row_once(lengths, budget, seed):
    lengths = np.asarray(lengths)
    order = np.random.default_rng(seed).permutation(len(lengths))
    plan = pack_rows(order, lengths, budget)
    assert sorted(plan.rows.tolist()) == list(range(len(lengths)))
    assert all(lengths[plan[j]].sum() <= budget for j in range(len(plan)))
    assert plan.digest() == pack_rows(order, lengths, budget).digest()
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        pack_rows(order, lengths, int(lengths.max()) - 1)


def test_shifted_labels_and_padding_batch():
    ids, trained = np.array([5, 6, 7, 8]), np.array([False, True, False, True])
    assert shifted_labels(ids, trained).tolist() == [6, IGNORE_INDEX, 8, IGNORE_INDEX]
    filler = padding_batch(sp_rank=1, sp_size=2, pad_id=3)
    assert filler["is_padding"] and int(filler["num_valid_tokens"]) == 0 and filler["sample_index"] == []
    assert filler["input_ids"].tolist() == [[3]] and filler["cu_seqlens"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="an SP slice"):
        unpack(collate([random_sample(np.random.default_rng(0), 0, 5)], sp_rank=0, sp_size=2))


def test_packed_forward_equals_per_sample_forwards():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from veomni.models.hf.attention import register_hf_attention

    register_hf_attention(["sdpa"])
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.set_attn_implementation("veomni_sdpa")
    rng = np.random.default_rng(1)
    samples = [random_sample(rng, i, n) for i, n in enumerate([7, 1, 19, 12])]
    batch = collate(samples)
    with torch.no_grad():
        packed = model(**model_inputs(batch)).logits[0]
        for (start, end), s in zip(
            zip(batch["cu_seqlens"][:-1], batch["cu_seqlens"][1:], strict=True), samples, strict=True
        ):
            alone = model(input_ids=torch.from_numpy(s.input_ids)[None]).logits[0]
            torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-5)
    inputs = model_inputs(batch, "cpu")
    assert inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"] and inputs["max_length_q"] == 19
