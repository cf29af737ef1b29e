"""fp16 dynamic loss scaling and the divergence check (`veomni.train.numerics`).

Without loss scaling an fp16 backward flushes gradients below ~6e-8 to zero; without a divergence check a nan
gradient is written into every weight by AdamW and the run goes on saving nan checkpoints (pruning good ones).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_loop import DENSE, tiny_recipe

from veomni.train.numerics import DynamicLossScale, TrainingDivergedError, check_finite, local_weights_finite
from veomni.train.recipe import RecipeError, recipe_from_dict

SMALL = dict(
    num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1
)


def test_the_scale_halves_on_overflow_doubles_after_the_interval_and_resumes_exactly():
    scale = DynamicLossScale(torch.device("cpu"), init_scale=8.0, growth_interval=3)
    seen = []
    for finite in (True, True, False, True, True, True, True):
        scale.update(finite)
        seen.append((scale.value, scale.finite_steps, scale.scale.item()))
    # 2 finite, an overflow halves (and restarts the count), 3 finite double, one more counts.
    assert seen == [(8, 1, 8), (8, 2, 8), (4, 0, 4), (4, 1, 4), (4, 2, 4), (8, 0, 8), (8, 1, 8)]
    again = DynamicLossScale(torch.device("cpu"))
    tensor = again.scale
    again.load_state_dict(scale.state_dict())
    assert again.state_dict() == {"scale": 8.0, "finite_steps": 1}
    assert again.scale is tensor and tensor.item() == 8.0  # in place: a captured CUDA graph keeps reading it


def test_overflow_without_any_scaling_left_is_an_error():
    scale = DynamicLossScale(torch.device("cpu"), init_scale=1.0)
    scale.update(False)  # 1 -> 0.5: an overflow at scale 1 may still be the scale's doing (accumulation)
    with pytest.raises(TrainingDivergedError, match=r"non-finite even at loss scale 0\.5.*bfloat16"):
        scale.update(False)
    with pytest.raises(ValueError, match="init_scale > 0"):
        DynamicLossScale(torch.device("cpu"), init_scale=math.inf)


def test_check_finite_names_the_step_the_values_and_the_checkpoint():
    check_finite(3, {"loss": 1.0, "grad_norm": 2.0}, None)
    with pytest.raises(
        TrainingDivergedError, match=r"step 7 diverged: loss nan, gradient norm inf.*out/step_5"
    ):
        check_finite(7, {"loss": math.nan, "grad_norm": math.inf}, "out/step_5")


def test_the_divergence_message_says_what_was_found_in_the_weights():
    stats = {"loss": 2.0, "grad_norm": math.inf}
    # An inf norm clipped to a zero coefficient can leave the weights finite: the message must not claim otherwise.
    with pytest.raises(TrainingDivergedError) as info:
        check_finite(4, stats, None, weights_finite=True, last_step=4)
    assert "the weights in memory are still finite" in str(info.value)
    assert "written" not in str(info.value) and "non-finite values" not in str(info.value)
    with pytest.raises(TrainingDivergedError, match=r"steps 5..8, run before its numbers were read\), and the "
                       r"weights in memory now hold non-finite values"):  # fmt: skip
        check_finite(4, stats, None, weights_finite=False, last_step=8)
    with pytest.raises(TrainingDivergedError, match="the weights in memory were not checked"):
        check_finite(4, stats, None)


def test_local_weights_finite_reads_every_parameter():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    assert local_weights_finite(module)
    with torch.no_grad():
        module[1].bias[0] = math.nan
    assert not local_weights_finite(module)


def test_fp16_compute_needs_fp32_parameters(tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["model"].update({"dtype": "float16", "param_dtype": "float16"})
    with pytest.raises(
        RecipeError, match="model.param_dtype: model.dtype float16 trains over float32 parameters"
    ):
        recipe_from_dict(raw)


def _overflowing_steps(ctx, raw: dict, start_scale: float, n: int) -> list[dict]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    run.loss_scale.load_state_dict({"scale": start_scale, "finite_steps": 0})
    it = iter(run.train_data)
    out = []
    for _ in range(n):
        params = [p.detach().clone() for p in run.trained.parameters()]
        epoch = run.scheduler.last_epoch
        stats = train_step(run, next(it))
        changed = any(
            not torch.equal(a, b.detach()) for a, b in zip(params, run.trained.parameters(), strict=True)
        )
        out.append({
            "stats": stats, "scale": run.loss_scale.value, "params_changed": changed,
            "schedule_stepped": run.scheduler.last_epoch != epoch, "overflow_steps": run.overflow_steps,
            "grads": sum(p.grad is not None and bool(p.grad.count_nonzero()) for p in run.trained.parameters()),
        })  # fmt: skip
    return out


@pytest.mark.parametrize(
    "world, force_fsdp2", [(1, False), (1, True), (2, True)], ids=["masters", "fsdp2", "fsdp2x2"]
)
def test_an_fp16_overflow_skips_the_step_and_halves_the_scale(dist_pools, tmp_path, world, force_fsdp2):
    raw = tiny_recipe(str(tmp_path), DENSE, steps=6, tokens_per_step=512, tokens_per_micro_batch=256)
    raw["model"]["dtype"] = "float16"
    raw["model"]["config"].update(SMALL)
    raw["parallel"]["force_fsdp2"] = force_fsdp2
    # The gradient norm is ~1.3 here: 2^21 times it overflows fp16 (max 65504) in the backward, and the scale
    # halves until it fits (2^18 on one rank).
    start = 2.0**21
    results = dist_pools.get(world, "gloo").run(_overflowing_steps, raw, start, 6)
    steps = results[0]
    for got in results[1:]:  # the global norm decides: every rank skips alike
        assert [s["scale"] for s in got] == [s["scale"] for s in steps]
    overflowed = [s["stats"]["skipped"] == 1.0 for s in steps]
    assert overflowed[0] and not overflowed[-1], overflowed
    first_trained = overflowed.index(False)
    for i, s in enumerate(steps):
        if overflowed[i]:
            assert math.isnan(s["stats"]["loss"]) and not s["params_changed"] and not s["schedule_stepped"]
            assert (
                s["scale"] == start / 2 ** (i + 1) and s["grads"] == 0
            )  # gradients dropped, not carried over
        else:
            assert math.isfinite(s["stats"]["grad_norm"]) and s["params_changed"] and s["schedule_stepped"]
            assert s["scale"] == steps[first_trained - 1]["scale"]
    assert steps[-1]["overflow_steps"] == first_trained


def _one_step_norm(ctx, raw: dict, scale: float | None) -> dict[str, float]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    if scale is not None:
        run.loss_scale.load_state_dict({"scale": scale, "finite_steps": 0})
    stats = train_step(run, next(iter(run.train_data)))
    # AdamW's first step leaves exp_avg = (1 - beta1) x the gradient it was given: clipped and unscaled.
    first_moments = [run.optimizer.state[p]["exp_avg"].detach().clone() for p in run.trained.parameters()]
    return {**stats, "first_moments": first_moments}


def test_scaled_fp16_gradients_are_unscaled_before_clipping_and_the_step(dist_pools, tmp_path):
    # The norm is reported and clipped unscaled, and the optimizer is given the unscaled, clipped gradients: those
    # of the fp32 run up to fp16 rounding.
    raw = tiny_recipe(str(tmp_path), DENSE, steps=1, tokens_per_step=256, tokens_per_micro_batch=256)
    raw["model"]["dtype"] = "float16"
    raw["model"]["config"].update(SMALL)
    raw["optim"]["max_grad_norm"] = 1e-3  # clipping active: the coefficient must see the unscaled norm
    pool = dist_pools.get(1, "gloo")
    (unscaled,) = pool.run(_one_step_norm, raw, 1.0)
    (scaled,) = pool.run(_one_step_norm, raw, 2.0**12)
    raw32 = {**raw, "model": {**raw["model"], "dtype": "float32"}}
    (fp32,) = pool.run(_one_step_norm, raw32, None)
    assert scaled["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=2e-2)
    assert unscaled["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=2e-2)
    largest = max(m.abs().max().item() for m in fp32["first_moments"])
    for a, b in zip(scaled["first_moments"], fp32["first_moments"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * largest)


def _save_then_resume(ctx, raw: dict) -> tuple[dict, dict]:
    from veomni.train.loop import _save, build_run

    run = build_run(recipe_from_dict(raw))
    run.loss_scale.load_state_dict({"scale": 2.0**9, "finite_steps": 17})
    run.overflow_steps = 3
    _save(run)
    run.checkpoints.wait()
    again = build_run(recipe_from_dict({**raw, "checkpoint": {**raw["checkpoint"], "resume": "auto"}}))
    return run.loss_scale.state_dict(), {
        **again.loss_scale.state_dict(),
        "overflow_steps": again.overflow_steps,
    }


def test_the_loss_scale_resumes_from_the_checkpoint(dist_pools, tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE, steps=1)
    raw["model"]["dtype"] = "float16"
    raw["model"]["config"].update(SMALL)
    saved, resumed = dist_pools.get(1, "gloo").run(_save_then_resume, raw)[0]
    assert resumed == {**saved, "overflow_steps": 3} and saved == {"scale": 512.0, "finite_steps": 17}


def _train_diverging(ctx, raw: dict) -> str:
    from veomni.train.loop import train

    with pytest.raises(TrainingDivergedError) as info:
        train(recipe_from_dict(raw))
    return str(info.value)


def test_a_diverged_step_stops_the_run_before_anything_is_saved(dist_pools, tmp_path):
    # lr 1e30: the first update sends every weight to ~1e30, the second forward overflows fp32 (nan loss). The
    # step-1 checkpoint stays; step 2's is never written; the metrics name the step.
    raw = tiny_recipe(str(tmp_path / "job"), DENSE, steps=4)
    raw["optim"].update({"lr": 1e30, "warmup_steps": 0, "max_grad_norm": None})
    raw["checkpoint"].update({"interval": 1, "keep_last": 1})
    raw["train"]["log_interval"] = 4  # the check runs when the numbers are read, before any save
    message = dist_pools.get(1, "gloo").run(_train_diverging, raw)[0]
    assert "step 2 diverged:" in message and "gradient norm nan" in message and "step_00000001" in message
    assert "the weights in memory now hold non-finite values" in message
    assert sorted(p.name for p in (tmp_path / "job").glob("step_*")) == ["step_00000001"]
    records = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and records[-1]["diverged"] is True


def _gpu_fp16_steps(tmp_path, name: str, graphs: bool, ops: dict) -> tuple[list[dict], float]:
    from veomni.train.loop import build_run, train_step

    raw = tiny_recipe(str(tmp_path / name), DENSE, steps=8, cuda_graphs=graphs)
    raw["ops"] = ops
    raw["train"]["device"] = "cuda"
    raw["model"]["dtype"] = "float16"
    run = build_run(recipe_from_dict(raw))
    run.loss_scale.load_state_dict({"scale": 2.0**22, "finite_steps": 0})
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(run.total_steps)], run.loss_scale.value


@pytest.mark.cuda
@pytest.mark.parametrize(
    "ops", [{"attention": "sdpa", "compile": "off"}, {}], ids=["eager-blocks", "defaults"]
)
def test_gpu_fp16_loss_scaling_with_and_without_cuda_graphs(tmp_path, ops):
    # The captured graphs multiply by the scale tensor they were captured with: its in-place updates must reach
    # the replays, so graphed steps skip and train exactly as eager ones.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager, eager_scale = _gpu_fp16_steps(tmp_path, "eager", False, ops)
    graphed, graphed_scale = _gpu_fp16_steps(tmp_path, "graphs", True, ops)
    skipped = [s["skipped"] for s in eager]
    assert skipped[0] == 1.0 and skipped[-1] == 0.0, skipped
    assert [s["skipped"] for s in graphed] == skipped and graphed_scale == eager_scale
    for a, b in zip(graphed, eager, strict=True):
        if not a["skipped"]:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)


def _diverge_with_a_save_in_flight(ctx, raw: dict) -> list[str]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    run.loss_scale.load_state_dict({"scale": 0.5, "finite_steps": 0})  # no scaling left to take off
    run.loss_scale.scale.fill_(2.0**40)  # ... while this backward still overflows
    events = []
    run.checkpoints.wait = lambda: events.append("waited")
    try:
        train_step(run, next(iter(run.train_data)))
    except TrainingDivergedError:
        events.append("diverged")
    return events


def test_an_fp16_divergence_lets_a_save_in_flight_finish(dist_pools, tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["model"]["dtype"] = "float16"
    raw["model"]["config"].update(SMALL)
    assert dist_pools.get(1, "gloo").run(_diverge_with_a_save_in_flight, raw)[0] == ["waited", "diverged"]
