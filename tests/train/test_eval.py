"""The evaluation pass on real gloo ranks: its loss is the one-process token mean over the eval set on every DP/SP
layout, and the training loop evaluates the model it finishes with."""

from __future__ import annotations

import copy
import json

import pytest
from dist_harness import backend_params
from test_loop import DENSE, initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

EVAL_FILES = ["builtin://quickstart/eval.jsonl"]


def eval_recipe(tmp: str, weights: str | None = None, **train) -> dict:
    """`tiny_recipe` of the dense model with the quickstart's eval rows."""
    raw = tiny_recipe(tmp, DENSE, weights=weights, **train)
    raw["data"]["eval_files"] = list(EVAL_FILES)
    raw["train"]["eval_interval"] = raw["train"]["eval_interval"] or 1
    return raw


def _train(ctx, raw: dict) -> list[dict[str, float]]:
    from veomni.train.loop import train

    return train(recipe_from_dict(raw))["eval"]


def test_the_last_step_is_evaluated(dist_pools, tmp_path):
    # An interval that does not divide the run: the finished model (the one saved and exported) still gets its
    # eval, as it does when the interval is longer than the run (the eval data would otherwise go unused).
    pool = dist_pools.get(1, "gloo")
    for steps, interval, want in ((3, 2, [2, 3]), (2, 5, [2]), (4, 2, [2, 4])):
        raw = eval_recipe(str(tmp_path / f"{steps}_{interval}"), steps=steps, eval_interval=interval)
        history = pool.run(_train, raw)[0]
        assert [e["step"] for e in history] == want, (steps, interval)
        records = [json.loads(line) for line in (tmp_path / f"{steps}_{interval}" / "metrics.jsonl").open()]
        assert [r["step"] for r in records if "eval_loss" in r] == want


def _per_document_reference(ctx, raw: dict) -> tuple[float, int]:
    """Σ token loss / trained tokens of plain transformers run on each eval row alone (no packing, no veomni)."""
    import torch
    from transformers import AutoModelForCausalLM

    from veomni.train.data import encode_row
    from veomni.train.loop import build_run

    data = build_run(recipe_from_dict(raw)).eval_data
    model = AutoModelForCausalLM.from_pretrained(raw["model"]["weights"]).eval()
    total, count = 0.0, 0
    for row in range(data.index.num_rows):
        sample = encode_row(
            data.source, data._dataset.encoder, row, raw["data"]["max_seq_len"], raw["data"]["overlong"]
        )
        ids = torch.as_tensor(sample.input_ids)
        target = ids.masked_fill(~torch.as_tensor(sample.trained), -100)[1:]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
        count += int((target != -100).sum())
    return total / count, count


def _evaluate(ctx, raw: dict) -> tuple[dict[str, float], int, int]:
    from veomni.train.loop import build_run
    from veomni.train.step import evaluate

    run = build_run(recipe_from_dict(raw))
    return evaluate(run), len(run.eval_data), len(run.eval_data.plan)


@pytest.fixture(scope="module")
def reference(dist_pools, tmp_path_factory):
    weights = initial_weights(DENSE, str(tmp_path_factory.mktemp("eval_init")))
    raw = eval_recipe(str(tmp_path_factory.mktemp("eval_ref")), weights=weights)
    return raw, dist_pools.get(1, "gloo").run(_per_document_reference, raw)[0]


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2))
def test_eval_loss_is_the_one_process_token_mean(dist_pools, reference, tmp_path, world_size, backend):
    # Token-weighted over the whole eval set whatever the layout: packed rows, DP ranks with unequal shares (9
    # micro-batches over 2 ranks: one rank runs a filler batch), SP slices of each row.
    raw, (want, trained) = reference
    assert trained > 0
    layouts = [(1, 1)] if world_size == 1 else [(2, 1), (1, 2)]
    for dp_replicate, sp in layouts:
        run_raw = copy.deepcopy(raw)
        run_raw["parallel"].update({"dp_replicate": dp_replicate, "sp": sp})
        run_raw["checkpoint"]["dir"] = str(tmp_path / f"{dp_replicate}{sp}")
        if backend == "nccl":
            run_raw["train"]["device"] = "cuda"
        tol = 1e-6 if backend == "gloo" else 1e-4
        for result, per_rank, micro_batches in dist_pools.get(world_size, backend).run(_evaluate, run_raw):
            assert micro_batches % 2 == 1  # so that one DP rank runs a filler batch
            assert per_rank == -(-micro_batches // (world_size // sp))
            assert result["eval_loss"] == pytest.approx(want, rel=tol), (dp_replicate, sp)


def _evaluate_without_eval_files(ctx, raw: dict) -> str:
    from veomni.train.loop import build_run
    from veomni.train.step import evaluate

    run = build_run(recipe_from_dict(raw))
    with pytest.raises(ValueError, match="data.eval_files") as err:
        evaluate(run)
    return str(err.value)


def test_evaluate_without_eval_files_says_so(dist_pools, tmp_path):
    # evaluate() is usable on its own (tests, benchmarks): a run built without eval files is a clear error, not a
    # bare assert (or, under python -O, iterating None).
    raw = tiny_recipe(str(tmp_path), DENSE)
    assert "no data.eval_files" in dist_pools.get(1, "gloo").run(_evaluate_without_eval_files, raw)[0]
