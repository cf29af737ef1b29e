"""Mixtures of sources (``data.sources``; `veomni.train.data.mixture_plan`, `veomni.train.data.mixture`): realised
token shares within sampling error of the weights, exact passes by epochs, exact resume and resume on another DP
size, per-source token counts and exact per-source losses in the trainer's metrics, recipe errors."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
from data_helpers import text_data, tokenizer, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import DENSE, tiny_recipe

from veomni.train.data import DataError, DataTopology
from veomni.train.data.build import build_train_data
from veomni.train.data.mixture import MixtureData, MixturePart
from veomni.train.data.mixture_plan import MixturePlan
from veomni.train.data.plan import DatasetIndex
from veomni.train.recipe import ASSETS_DIR, RecipeError, recipe_from_dict

BUDGET = 256


def synthetic(rng: np.random.Generator, rows: int, longest: int) -> DatasetIndex:
    lengths = rng.integers(1, longest + 1, size=rows).astype(np.int64)
    return DatasetIndex(lengths=lengths, trained=lengths - 1, truncated=0, dropped=0)


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.floats(0.2, 5.0), min_size=2, max_size=4),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_realised_token_shares_follow_the_weights_within_sampling_error(weights, seed, shuffle):
    rng = np.random.default_rng(seed)
    # Sources of different sizes and row lengths, so their micro-batches fill differently.
    indexes = [synthetic(rng, int(rng.integers(20, 200)), int(rng.choice([16, 64, 200]))) for _ in weights]
    plan = MixturePlan(indexes, weights=weights, epochs=None, seed=seed, budget=BUDGET, shuffle=shuffle)
    lengths = np.concatenate([i.lengths for i in indexes])
    part_of = np.repeat(np.arange(len(indexes)), [len(i.lengths) for i in indexes])
    tokens, drawn, e = np.zeros(len(weights)), 0, 0
    while drawn < 3000:
        batches = plan.round(e)
        tokens += np.bincount(part_of[batches.rows], weights=lengths[batches.rows], minlength=len(weights))
        assert all(
            part_of[batches[j]].tolist() == [batches.sources[j]] * len(batches[j])
            for j in range(len(batches))
        )
        drawn, e = drawn + len(batches), e + 1
    share, want = tokens / tokens.sum(), np.asarray(weights) / sum(weights)
    # Each micro-batch is drawn independently: from source s with probability p_s, bringing f tokens (f from the
    # fills of its micro-batches, mean mu_s). T_s, its tokens over n draws, has mean n p_s mu_s and variance
    # n (p_s E[f^2] - p_s^2 mu_s^2); five standard deviations of T_s and of the total bound the share (delta
    # method), plus 1% for a later epoch packing a little differently from the first one.
    fills = [
        np.asarray([st_.index.lengths[b].sum() for b in _batches(st_.plan(0))], dtype=float)
        for st_ in plan.streams
    ]
    p = plan.probabilities
    mean = np.asarray([f.mean() for f in fills])
    var = drawn * (p * np.asarray([(f**2).mean() for f in fills]) - p**2 * mean**2)
    expected = drawn * p * mean
    relative = 5 * np.sqrt(var) / expected + 5 * np.sqrt(var.sum()) / expected.sum() + 0.01
    assert np.all(np.abs(share - want) <= want * relative), (share, want, want * relative)


def _batches(plan):
    return [plan[j] for j in range(len(plan))]


@settings(max_examples=15, deadline=None)
@given(
    epochs=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=1, max_size=3), seed=st.integers(0, 999)
)
def test_epochs_pass_over_every_row_exactly(epochs, seed):
    rng = np.random.default_rng(seed)
    indexes = [synthetic(rng, int(rng.integers(10, 80)), 64) for _ in epochs]
    plan = MixturePlan(indexes, weights=None, epochs=epochs, seed=seed, budget=BUDGET, shuffle=True)
    rows = np.concatenate(
        [plan.round(e).rows for e in range(2)]
    )  # two rounds: every fractional pass completes
    seen = np.bincount(rows, minlength=int(plan.offsets[-1]))
    want = np.repeat([2 * n for n in epochs], [len(i.lengths) for i in indexes])
    assert seen.tolist() == want.astype(int).tolist()


def test_the_plan_is_seeded_and_alike_in_every_process():
    rng = np.random.default_rng(0)
    indexes = [synthetic(rng, 50, 64), synthetic(rng, 120, 200)]

    def make(seed):
        return MixturePlan(indexes, weights=[1, 2], epochs=None, seed=seed, budget=BUDGET, shuffle=True)

    assert [make(3).round(e).digest() for e in range(3)] == [make(3).round(e).digest() for e in range(3)]
    assert make(3).round(1).digest() != make(4).round(1).digest()
    late = make(3)
    assert (
        late.round(5).digest() == [make(3).round(e) for e in range(6)][5].digest()
    )  # any round, in any order
    # Unshuffled, a round interleaves its sources evenly: both are in either half of it.
    even = (
        MixturePlan(indexes, weights=None, epochs=[1, 1], seed=0, budget=BUDGET, shuffle=False)
        .round(0)
        .sources
    )
    assert set(even[: len(even) // 2].tolist()) == set(even[len(even) // 2 :].tolist()) == {0, 1}


# --- MixtureData: resume, DP sizes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    a = text_data(root / "a.jsonl", rows=90, seed=1)
    b = text_data(root / "b.jsonl", rows=40, seed=2, max_seq_len=64)
    return [MixturePart("a", *a, weight=3.0), MixturePart("b", *b, weight=1.0)]


def mixture(parts, *, dp_rank=0, dp_size=1, grad_accum=2, **kwargs) -> MixtureData:
    args = dict(tokens_per_micro_batch=128, seed=7, shuffle=True, max_seq_len=64, overlong="truncate")
    args.update(kwargs)
    return MixtureData(
        parts, topology=DataTopology(dp_rank=dp_rank, dp_size=dp_size), grad_accum=grad_accum, **args
    )


def take(data, n):
    return list(itertools.islice(iter(data), n))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_is_exact(parts, num_workers):
    make = lambda: mixture(parts, dp_rank=1, dp_size=2, grad_accum=1, num_workers=num_workers)  # noqa: E731
    per_round = make().steps_in_epoch(0)
    total, k = per_round + 3, per_round - 2  # the resumed run crosses a round boundary
    straight = take(make(), total)
    first = make()
    head = take(first, k)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for x, y in zip(head + take(resumed, total - k), straight, strict=True):
        assert (x.step, x.epoch, x.tokens, x.valid_tokens, x.sources) == (
            y.step,
            y.epoch,
            y.tokens,
            y.valid_tokens,
            y.sources,
        )
        for bx, by in zip(x.micro_batches, y.micro_batches, strict=True):
            assert torch.equal(bx["input_ids"], by["input_ids"]) and bx["source"] == by["source"]
            assert bx["sample_index"] == by["sample_index"]


def test_resume_on_another_dp_size_continues_at_the_same_micro_batch(parts):
    def step_rows(dp, grad_accum, n, state=None):
        streams = []
        for r in range(dp):
            data = mixture(parts, dp_rank=r, dp_size=dp, grad_accum=grad_accum)
            if state is not None:
                data.load_state_dict(state)
            streams.append(take(data, n))
        per_step = [
            sorted(i for s in steps for b in s.micro_batches for i in b["sample_index"])
            for steps in zip(*streams, strict=True)
        ]
        return per_step, [steps[0].sources for steps in zip(*streams, strict=True)]

    k = 3
    reference, sources = step_rows(dp=1, grad_accum=4, n=k + 4)
    saver = mixture(parts, dp_rank=0, dp_size=1, grad_accum=4)
    take(saver, k)
    state = saver.state_dict()
    assert step_rows(dp=2, grad_accum=2, n=4, state=state) == (reference[k:], sources[k:])
    assert step_rows(dp=4, grad_accum=1, n=4, state=state) == (reference[k:], sources[k:])


def test_step_counts_are_per_source_and_global(parts):
    ranks = [take(mixture(parts, dp_rank=r, dp_size=2, grad_accum=2), 5) for r in range(2)]
    for steps in zip(*ranks, strict=True):
        assert steps[0].sources == steps[1].sources
        for s in range(len(steps[0].sources)):
            mine = [b for st_ in steps for b in st_.micro_batches if b["source"] == s]
            assert steps[0].sources[s][1] == sum(b["seq_len"] for b in mine)
            assert steps[0].sources[s][2] == sum(int(b["num_valid_tokens"]) for b in mine)


def test_resume_refuses_another_mixture(parts):
    data = mixture(parts)
    take(data, 2)
    state = data.state_dict()
    with pytest.raises(DataError, match="mixture_digest"):
        mixture(
            [parts[0], MixturePart("b", parts[1].source, parts[1].encoder, parts[1].index, weight=2.0)]
        ).load_state_dict(state)
    with pytest.raises(DataError, match=r"sources: saved \['a', 'b'\], now \['a'\]"):
        mixture(parts[:1]).load_state_dict(state)
    with pytest.raises(DataError, match="expected 'veomni.train.data.mixture/1'"):
        mixture(parts).load_state_dict({**state, "format": "veomni.train.data/1"})


# --- recipes -------------------------------------------------------------------------------------------------------

QS = str(ASSETS_DIR / "quickstart")


def mix_recipe(tmp: str, sources: list[dict], **train) -> dict:
    raw = tiny_recipe(tmp, DENSE, **train)
    raw["data"]["train_files"] = []
    raw["data"]["sources"] = sources
    return raw


def _sources(weights=(3, 1)) -> list[dict]:
    return [
        {"name": "chat", "files": [f"{QS}/train.jsonl"], "weight": weights[0]},
        {"name": "held", "files": [f"{QS}/eval.jsonl"], "weight": weights[1], "format": "messages"},
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda s: s[0].update(wieght=1),
            r"data.sources\[0\]: unknown key 'wieght' \(did you mean 'weight'\?\)",
        ),
        (lambda s: s[1].pop("name"), r"data.sources\[1\]: needs a name"),
        (lambda s: s[1].update(name="chat"), r"the name 'chat' is taken by data.sources\[0\]"),
        (lambda s: s[0].update(dataset={"path": "json"}), r"\(chat\): give its rows as files .* or dataset"),
        (lambda s: s[0].update(epochs=1), r"\(chat\): give weight .* or epochs .*, one"),
        (lambda s: s[0].update(weight=0), r"\(chat\): weight must be a positive number, found 0"),
        (
            lambda s: s[1].update(epochs=s[1].pop("weight")),
            "every source gives weight, or every source gives epochs",
        ),
        (
            lambda s: s[1].update(format="sharegtp"),
            r"data.sources\[1\] \(held\): data.format: .*did you mean 'sharegpt'",
        ),
        (
            lambda s: s[1].update(format="llava"),
            r"\(held\): data.format: llava rows are converted for data.kind",
        ),
    ],
)
def test_recipe_errors_name_the_source(tmp_path, change, message):
    sources = _sources()
    change(sources)
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(mix_recipe(str(tmp_path), sources))


def test_a_mixture_replaces_the_files_and_weights_need_steps(tmp_path):
    raw = mix_recipe(str(tmp_path), _sources())
    raw["data"]["train_files"] = [f"{QS}/train.jsonl"]
    with pytest.raises(RecipeError, match="data.train_files .*, data.dataset or data.sources, exactly one"):
        recipe_from_dict(raw)
    raw = mix_recipe(str(tmp_path), _sources(), steps=None, epochs=1)
    with pytest.raises(RecipeError, match="train.epochs: a mixture by weight has no epochs"):
        recipe_from_dict(raw)
    by_epochs = [{**s, "epochs": 1} for s in _sources()]
    for s in by_epochs:
        s.pop("weight")
    recipe = recipe_from_dict(mix_recipe(str(tmp_path), by_epochs, steps=None, epochs=2))
    data = build_train_data(recipe, tokenizer(), DataTopology())
    steps = data.total_steps(2)
    assert steps == 2 * data.steps_in_epoch(0) or steps == data.steps_in_epoch(0) + data.steps_in_epoch(1)
    assert recipe.data.sources[0]["files"] == [f"{QS}/train.jsonl"]  # paths resolved like data.train_files


# --- through the trainer --------------------------------------------------------------------------------------------


def _per_source_losses(ctx, raw: dict) -> list[tuple[dict, dict]]:
    """Per step: the trainer's per-source losses, and each recomputed from the same weights before the step: the
    summed token losses of the source's micro-batches over the source's trained tokens."""
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    out = []
    for step in itertools.islice(iter(run.train_data), 3):
        want = {}
        with torch.no_grad():
            for s, (name, _, trained) in enumerate(step.sources):
                mine = [b for b in step.micro_batches if b["source"] == s]
                if trained:
                    n = torch.full((), trained, dtype=torch.int64)
                    want[name] = sum(float(run.task.forward(run.model, b, run.device, n).loss) for b in mine)
        got = train_step(run, step)["sources"]
        out.append(({k: v["loss"] for k, v in got.items() if v["loss"] is not None}, want))
    return out


def _train(ctx, raw: dict) -> None:
    from veomni.train.loop import train

    train(recipe_from_dict(raw))


@pytest.mark.slow  # slow tier: a few steps of the tiny model on a mixture, then a CLI-like run
def test_per_source_losses_are_exact_and_reach_metrics_jsonl(dist_pools, tmp_path):
    pool = dist_pools.get(1, "gloo")
    raw = mix_recipe(str(tmp_path / "a"), _sources((1, 1)), steps=3)
    ((result),) = pool.run(_per_source_losses, raw)
    for got, want in result:
        assert got.keys() == want.keys() and got
        for name in got:
            assert got[name] == pytest.approx(want[name], rel=1e-5)
    raw = mix_recipe(str(tmp_path / "b"), _sources((1, 1)), steps=2)
    pool.run(_train, raw)
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [sorted(r["sources"]) for r in steps] == [["chat", "held"]] * 2
    for r in steps:
        trained = sum(v["trained_tokens"] for v in r["sources"].values())
        mean = (
            sum(v["loss"] * v["trained_tokens"] for v in r["sources"].values() if v["trained_tokens"])
            / trained
        )
        assert mean == pytest.approx(r["loss"], rel=1e-5)


def _resume(ctx, raw: dict, split: int, total: int) -> tuple[list, list]:
    from veomni.train.loop import _save, build_run, train_step

    def losses(run, n):
        it = iter(run.train_data)
        return [train_step(run, next(it)) for _ in range(n)]

    want = losses(build_run(recipe_from_dict(raw)), total)
    first = build_run(recipe_from_dict(raw))
    got = losses(first, split)
    _save(first)
    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    got += losses(build_run(recipe_from_dict(resumed)), total - split)
    return [(s["loss"], s["sources"]) for s in want], [(s["loss"], s["sources"]) for s in got]


@pytest.mark.slow  # slow tier: three short runs of the tiny model
def test_a_mixture_resumes_exactly_through_the_trainer(dist_pools, tmp_path):
    raw = mix_recipe(str(tmp_path), _sources(), steps=4)
    ((want, got),) = dist_pools.get(1, "gloo").run(_resume, raw, 2, 4)
    assert got == want


def test_a_source_of_no_trained_token_is_refused_naming_it(tmp_path):
    files = str(write_jsonl(tmp_path / "masked.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_mask": 0}]}] * 4))  # fmt: skip
    sources = [*_sources(), {"name": "masked", "files": [files], "weight": 1}]
    recipe = recipe_from_dict(mix_recipe(str(tmp_path), sources))
    with pytest.raises(DataError, match=r"data.sources\[2\] \(masked\): no trained token"):
        build_train_data(recipe, tokenizer(), DataTopology())
