"""Resume from a checkpoint saved before a gradient reached some trained parameters (issue 42), for any task.

AdamW keeps no state for a parameter until its first gradient: a checkpoint saved at step 0, or before the omni
thinker's ``audio_bos_eos_token`` (never used by the loss) or a VLM's tower (before its first image) got one, has
no optimizer state for them. `resume_before_gradients` runs a recipe straight through, then the same recipe saved
after ``split`` steps and resumed; the family tests assert the two loss curves are the same, bit for bit, and that
the checkpoint really lacked state for some trained parameters.
"""

from __future__ import annotations

import copy
from typing import Any


def stateless_params(run: Any) -> list[str]:
    """The trained parameters (by name) ``run``'s optimizer holds no state for."""
    names = {id(p): name for name, p in run.trained.named_parameters()}
    return sorted(names[id(p)] for group in run.optimizer.param_groups for p in group["params"]
                  if p not in run.optimizer.state)  # fmt: skip


def resume_before_gradients(ctx: Any, raw: dict, split: int, total: int) -> dict[str, Any]:
    """Losses of ``total`` steps straight (``want``) and of ``split`` steps, a save, a resume and the rest
    (``got``); ``stateless``: the trained parameters without optimizer state at the save; ``after_load``: those
    without state right after the resume (they must be the same: none invented on load)."""
    from veomni.train.loop import _save, build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    straight = build_run(recipe_from_dict(raw))
    it = iter(straight.train_data)
    want = [float(train_step(straight, next(it))["loss"]) for _ in range(total)]
    del straight

    first = build_run(recipe_from_dict(raw))
    it = iter(first.train_data)
    got = [float(train_step(first, next(it))["loss"]) for _ in range(split)]
    stateless = stateless_params(first)
    _save(first)
    assert stateless_params(first) == stateless, "saving changed which parameters have optimizer state"
    del first

    resumed_raw = copy.deepcopy(raw)
    resumed_raw["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed_raw))
    assert second.step == split, (second.step, split)
    after_load = stateless_params(second)
    it = iter(second.train_data)
    got += [float(train_step(second, next(it))["loss"]) for _ in range(total - split)]
    return {"want": want, "got": got, "stateless": stateless, "after_load": after_load}


def check_exact_resume(result: dict[str, Any], *, some: str | None = None) -> None:
    """Assert `resume_before_gradients`' ``result`` resumed exactly from a checkpoint lacking optimizer state for
    at least one trained parameter (``some``: a substring one of them must contain)."""
    assert result["stateless"], "every trained parameter had optimizer state at the save: nothing was tested"
    if some is not None:
        assert any(some in name for name in result["stateless"]), result["stateless"]
    assert result["after_load"] == result["stateless"]
    assert result["got"] == result["want"]
