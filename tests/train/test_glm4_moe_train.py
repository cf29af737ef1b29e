"""GLM-4.5 MoE in the text trainer: with ``optim.moe_bias_update_speed`` the family's ``balanced_routers`` hook
(`veomni.models.glm4_moe.family`) puts the router's correction bias under the aux-loss-free sign rule, over the step's
global load on 2 gloo ranks (the layout grid itself is test_loop's, where glm4_moe is one of the models)."""

from __future__ import annotations

import torch
from test_loop import GLM4_MOE, initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 2
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _balanced_steps(ctx, raw: dict) -> dict:
    """Per step: this rank's own count of the router's picks (a hook beside veomni's counter) and the bias after."""
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    (router,) = run.balanced_routers
    picks: list[torch.Tensor] = []
    handle = router.register_forward_hook(
        lambda m, args, out: picks.append(out[2].detach().reshape(-1).cpu())
    )
    chosen, biases = [], []
    it = iter(run.train_data)
    for _ in range(STEPS):
        picks.clear()
        train_step(run, next(it))
        chosen.append(torch.bincount(torch.cat(picks), minlength=8).float())
        biases.append(dict(run.model.named_buffers())[BIAS].detach().cpu().clone())
    handle.remove()
    return {"chosen": chosen, "biases": biases}


def test_aux_free_bias_update_follows_the_sign_rule_over_both_ranks(dist_pools, tmp_path):
    weights = initial_weights(GLM4_MOE, str(tmp_path / "init"))
    speed = 0.01
    raw = tiny_recipe(str(tmp_path / "run"), GLM4_MOE, weights=weights, steps=STEPS)
    raw["optim"]["moe_bias_update_speed"] = speed
    results = dist_pools.get(2, "gloo").run(_balanced_steps, raw)
    bias = torch.zeros(8)  # as transformers initialises it
    for step in range(STEPS):
        # The load: every rank's (token, choice) pairs, all micro-batches.
        load = sum(r["chosen"][step] for r in results)
        assert load.sum() > 0
        bias = bias + speed * torch.sign(load.mean() - load)
        for r in results:
            torch.testing.assert_close(r["biases"][step], bias, rtol=0, atol=1e-6)
    assert bias.abs().sum() > 0
