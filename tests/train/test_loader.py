"""TrainData / EvalData: DP sharding, SP peers, step token counts, exact resume, resume on another DP size."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from data_helpers import text_data, train_data, write_jsonl

from veomni.train.data import DataError, DataTopology, EvalData


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return text_data(tmp_path_factory.mktemp("loader") / "train.jsonl", rows=90)


def take(td, n):
    return list(itertools.islice(iter(td), n))


def rows_of(step) -> list[int]:
    return [i for b in step.micro_batches for i in b["sample_index"]]


def assert_same_steps(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.step, x.epoch, x.tokens, x.valid_tokens) == (y.step, y.epoch, y.tokens, y.valid_tokens)
        for bx, by in zip(x.micro_batches, y.micro_batches, strict=True):
            assert bx.keys() == by.keys()
            for key in bx:
                if isinstance(bx[key], torch.Tensor):
                    assert torch.equal(bx[key], by[key]), key
                else:
                    assert bx[key] == by[key], key


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_dp_shards_are_disjoint_and_cover_the_epoch(data, dp):
    source, encoder, index = data
    ranks = [train_data(*data, dp_rank=r, dp_size=dp) for r in range(dp)]
    n = ranks[0].steps_in_epoch(0)
    seen = [sorted(i for s in take(td, n) for i in rows_of(s)) for td in ranks]
    flat = [i for rows in seen for i in rows]
    assert len(flat) == len(set(flat))  # disjoint
    plan = ranks[0].plan(0)
    used = plan.rows[: plan.offsets[n * ranks[0].per_step]]
    assert sorted(flat) == sorted(used.tolist())  # covering: every row of the epoch's whole steps
    left_out = len(plan) - n * ranks[0].per_step
    assert 0 <= left_out < ranks[0].per_step


def test_sp_peers_read_the_same_samples_and_split_them(data):
    peers = [train_data(*data, dp_rank=1, dp_size=2, sp_rank=r, sp_size=3) for r in range(3)]
    whole = train_data(*data, dp_rank=1, dp_size=2)
    for steps in zip(*(take(td, 3) for td in peers), take(whole, 3), strict=True):
        *parts, full = steps
        assert len({tuple(rows_of(s)) for s in steps}) == 1
        for g, full_batch in enumerate(full.micro_batches):
            joined = torch.cat([p.micro_batches[g]["input_ids"] for p in parts], dim=1)
            assert torch.equal(joined[:, : full_batch["seq_len"]], full_batch["input_ids"])


def test_step_valid_tokens_is_the_global_label_count(data):
    dp, sp = 2, 2
    streams = {
        (d, s): take(train_data(*data, dp_rank=d, dp_size=dp, sp_rank=s, sp_size=sp), 4)
        for d in range(dp)
        for s in range(sp)
    }
    for k in range(4):
        steps = [streams[key][k] for key in streams]
        counted = sum(int(b["num_valid_tokens"]) for st_ in steps for b in st_.micro_batches)
        assert all(st_.valid_tokens == counted for st_ in steps)
        sp0 = [streams[(d, 0)][k] for d in range(dp)]
        assert steps[0].tokens == sum(b["seq_len"] for st_ in sp0 for b in st_.micro_batches)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_is_exact(data, num_workers):
    make = lambda: train_data(*data, dp_rank=1, dp_size=2, num_workers=num_workers)  # noqa: E731
    per_epoch = make().steps_in_epoch(0)
    total, k = per_epoch + 3, per_epoch - 2  # the resumed run crosses an epoch boundary
    straight = take(make(), total)
    first = make()
    head = take(first, k)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_steps(head + take(resumed, total - k), straight)
    assert straight[per_epoch].epoch == 1 and straight[per_epoch - 1].epoch == 0


def test_resume_on_another_dp_size_continues_at_the_same_micro_batch(data):
    def step_rows(dp, grad_accum, n, state=None):
        """Per step, the sorted rows of the whole step over all DP ranks."""
        streams = []
        for r in range(dp):
            td = train_data(*data, dp_rank=r, dp_size=dp, grad_accum=grad_accum)
            if state is not None:
                td.load_state_dict(state)
            streams.append(take(td, n))
        return [sorted(i for s in steps for i in rows_of(s)) for steps in zip(*streams, strict=True)]

    k = 3
    reference = step_rows(dp=2, grad_accum=2, n=k + 4)
    saver = train_data(*data, dp_rank=0, dp_size=2, grad_accum=2)
    take(saver, k)
    state = saver.state_dict()
    assert step_rows(dp=1, grad_accum=4, n=4, state=state) == reference[k:]  # same steps, other ranks
    assert step_rows(dp=4, grad_accum=1, n=4, state=state) == reference[k:]


def test_resume_refuses_other_data_or_order(data, tmp_path):
    td = train_data(*data)
    take(td, 2)
    state = td.state_dict()
    with pytest.raises(DataError, match="seed: saved 7, now 8"):
        train_data(*data, seed=8).load_state_dict(state)
    with pytest.raises(DataError, match="tokens_per_micro_batch: saved 128, now 256"):
        train_data(*data, tokens_per_micro_batch=256).load_state_dict(state)
    other = text_data(tmp_path / "other.jsonl", rows=90, seed=1)
    with pytest.raises(DataError, match="index_digest"):
        train_data(*other).load_state_dict(state)
    with pytest.raises(DataError, match="format"):
        td.load_state_dict({**state, "format": "something/0"})


def test_total_steps_match_the_iteration(data):
    td = train_data(*data, dp_size=2)
    epochs = [s.epoch for s in take(td, td.total_steps(3))]
    assert [epochs.count(e) for e in range(3)] == [td.steps_in_epoch(e) for e in range(3)]
    assert epochs[-1] == 2 and next(iter(td)).epoch == 3  # the iterator itself goes on into epoch 3


def test_an_epoch_packed_into_less_than_one_step_is_skipped_as_total_steps_counts_it(tmp_path):
    # First-fit packing depends on the order: these four rows make 3 micro-batches of <= 14 tokens in epochs 0 and
    # 5 but 2 in epochs 1-4, fewer than one step of grad_accum 3. total_steps counts those epochs as 0 steps, so the
    # iterator must go on to epoch 5 rather than stop the run at step 1.
    from data_helpers import tokenizer

    from veomni.train.data import RowSource, build_encoder, index_dataset

    rows = [{"text": "alpha"}, {"text": "alpha"}, {"text": "alpha alpha"}, {"text": "alpha alpha"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    encoder = build_encoder(tokenizer(), "text")
    source = RowSource([str(path)], "auto", encoder.columns)
    index = index_dataset(source, encoder, max_seq_len=14, overlong="error")
    assert index.lengths.tolist() == [5, 5, 9, 9]
    td = train_data(source, encoder, index, tokens_per_micro_batch=14, grad_accum=3, seed=1, max_seq_len=14)
    assert [len(td.plan(e)) for e in range(6)] == [3, 2, 2, 2, 2, 3]
    assert td.total_steps(6) == 2
    steps = take(td, td.total_steps(6))
    assert [s.epoch for s in steps] == [0, 5]
    assert all(len(s.micro_batches) == 3 for s in steps)


def test_reiterating_makes_older_iterators_stale(data):
    td = train_data(*data)
    old = iter(td)
    next(old)
    next(iter(td))
    with pytest.raises(RuntimeError, match="stale"):
        next(old)


def test_a_row_changed_during_the_run_is_detected(tmp_path):
    path = tmp_path / "train.jsonl"
    data = text_data(path, rows=40)
    td = train_data(*data, shuffle=False)
    rows = [{"text": "alpha"}] * 40
    write_jsonl(path, rows)  # same line count, other lengths
    with pytest.raises(
        DataError, match=f"{path} line 1: now gives .* tokens, but .* when the data was indexed"
    ):
        next(iter(td))


def test_too_little_data_for_one_step(data):
    with pytest.raises(DataError, match="fewer than one step needs"):
        train_data(*data, grad_accum=64)


def test_eval_data_gives_every_rank_the_same_number_of_batches(data):
    source, encoder, index = data
    ranks = [
        EvalData(
            source,
            encoder,
            index,
            topology=DataTopology(dp_rank=r, dp_size=4),
            tokens_per_micro_batch=256,
            max_seq_len=64,
            overlong="truncate",
        )
        for r in range(4)
    ]
    batches = [list(e) for e in ranks]
    assert len({len(b) for b in batches}) == 1 and len(batches[0]) == len(ranks[0])
    rows = [i for per_rank in batches for b in per_rank for i in b["sample_index"]]
    assert sorted(rows) == list(range(index.num_rows))
    filler = [b for per_rank in batches for b in per_rank if b["is_padding"]]
    assert len(filler) == len(ranks[0]) * 4 - len(ranks[0].plan)
    assert all(int(b["num_valid_tokens"]) == 0 for b in filler)
    assert sum(int(b["num_valid_tokens"]) for per_rank in batches for b in per_rank) == ranks[0].valid_tokens
    # Rows are packed in file order (first-fit): within a batch they ascend.
    assert all(np.all(np.diff(b["sample_index"]) > 0) for per_rank in batches for b in per_rank)


def test_iterating_the_data_leaves_the_global_rng_alone(data):
    # Dropout draws from torch's global RNG. A DataLoader draws its workers' base seed from it whenever an iterator
    # is made: after a resume (RNG restored, then the train iterator made) the training stream was one draw off the
    # uninterrupted run's, and every evaluation pass moved it between two training steps.
    source, encoder, index = data
    evaluation = EvalData(source, encoder, index, topology=DataTopology(), tokens_per_micro_batch=256,
                          max_seq_len=64, overlong="truncate")  # fmt: skip
    torch.manual_seed(0)
    before = torch.get_rng_state()
    take(train_data(*data), 2)
    list(evaluation)
    assert torch.equal(torch.get_rng_state(), before)
