"""The evaluation pass on real gloo ranks: its loss is the one-process token mean over the eval set on every DP/SP
layout, and the training loop evaluates the model it finishes with."""

from __future__ import annotations

import json

from test_loop import DENSE, tiny_recipe

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
