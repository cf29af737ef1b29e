"""The trainer states each micro-batch's real length under SP, so the MoE routers' load-balancing statistics leave
the SP padding out: the router gradients of an SP2 micro-batch equal one process's on the same (unpadded) row."""

from __future__ import annotations

import copy

import torch
from test_loop import MOE, initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

# An odd micro-batch budget: packed rows of odd length, which SP2 pads by one token.
ODD = {"tokens_per_step": 1020, "tokens_per_micro_batch": 255}


def _router_grads(ctx, raw: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from veomni.train.loop import build_run
    from veomni.train.step import _forward_backward

    run = build_run(recipe_from_dict(raw))
    step = next(iter(run.train_data))
    # The first micro-batch that SP pads (the same row on every layout: dp is 1 in both runs).
    index = next(i for i, b in enumerate(step.micro_batches) if b["seq_len"] % 2)
    batch = step.micro_batches[index]
    num_items = torch.full((), float(step.valid_tokens), dtype=torch.float32)
    _forward_backward(run, batch, num_items, len(step.micro_batches))
    grads = {}
    for name, param in run.model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            grad = param.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return {"index": index, "seq_len": batch["seq_len"], "grads": grads}


def test_sp2_router_gradients_equal_one_process(dist_pools, tmp_path):
    model = {**copy.deepcopy(MOE), "router_aux_loss_coef": 1.0}  # the aux term dominates the router gradients
    weights = initial_weights(model, str(tmp_path / "init"))

    def recipe(name: str, sp: int) -> dict:
        raw = tiny_recipe(str(tmp_path / name), model, weights=weights, sp=sp, **ODD)
        raw["data"]["max_seq_len"] = ODD["tokens_per_micro_batch"]
        return raw

    one = dist_pools.get(1, "gloo").run(_router_grads, recipe("one", 1))[0]
    for got in dist_pools.get(2, "gloo").run(_router_grads, recipe("sp2", 2)):
        assert (got["index"], got["seq_len"]) == (one["index"], one["seq_len"])
        assert got["grads"].keys() == one["grads"].keys() and got["grads"]
        for name, want in one["grads"].items():
            torch.testing.assert_close(got["grads"][name], want, rtol=1e-5, atol=1e-7, msg=name)
