"""Smoke and parity test of tools/bench/bench_dit.py on CPU: a tiny Wan transformer, veomni against plain diffusers.

Every contender loads the same saved weights and trains on the same flow-matching inputs, so in fp32 their losses
and grad norms must agree step for step (a contender fed other weights, inputs, loss normalisation, parameter
groups or clipping diverges at once). Contenders whose kernels need CUDA are skipped with a reason in the JSON.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from bench_loader import load_bench

bench = load_bench("bench_dit.py")
import dit_contenders as contenders  # noqa: E402  (on sys.path once bench_dit is loaded)

SMOKE = ["--size", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--lr", "1e-3"]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops on 2 shared cores: one thread avoids oversubscription (a 15 ms step becomes 1 s without it).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_inputs_are_the_dit_task_flow_matching_inputs():
    steps = bench.make_steps(3, 2, "tiny", torch.float32, seed=5, device=torch.device("cpu"))
    again = bench.make_steps(3, 2, "tiny", torch.float32, seed=5, device=torch.device("cpu"))
    table = bench.FlowMatchingSchedule(num_train_timesteps=1000, shift=bench.SHIFT).timesteps()
    for s, t in zip(steps, again, strict=True):
        assert s["hidden_states"].shape == s["target"].shape == (2, 4, 3, 8, 8)
        assert s["encoder_hidden_states"].shape == (2, 16, 32) and s["timestep"].dtype == torch.float32
        assert all(bool((table == v).any()) for v in s["timestep"])  # values of the shifted training table
        assert all(torch.equal(s[k], t[k]) for k in s)  # seeded: every contender gets these tensors
        # noisy = latents + sigma * (noise - latents): the clean latents, normalised with Wan's VAE statistics,
        # must come out standard normal (the posterior means were drawn as latents_mean + latents_std * N(0, 1)).
        sigma = (s["timestep"] / 1000).view(-1, 1, 1, 1, 1)
        latents = s["hidden_states"] - sigma * s["target"]
        assert abs(float(latents.mean())) < 0.15 and abs(float(latents.std()) - 1) < 0.15
    assert not torch.equal(steps[0]["target"], steps[1]["target"])
    other = bench.make_steps(1, 2, "tiny", torch.float32, seed=6, device=torch.device("cpu"))
    assert not torch.equal(other[0]["hidden_states"], steps[0]["hidden_states"])


def test_plan_skips_what_cannot_run_here_with_a_reason():
    cpu, fp32 = torch.device("cpu"), torch.float32
    planned = dict(bench.plan(None, cpu, fp32))
    order = list(planned)
    assert order[:4] == ["diffusers", "veomni", "veomni_kernels", "veomni_keep_attention"]
    assert order[-2:] == ["veomni_compiled", "diffusers_compiled"]
    assert all(planned[n] is None for n in (*bench.FIRST, *bench.LAST) if n != "veomni_fa4")
    assert "flash_attn_4" in planned["veomni_fa4"] and "CUDA only" in planned["veomni_fa4"]
    assert "CUDA" in planned["diffusers_native_cudnn"] and "CUDA" in planned["diffusers_native_flash"]
    assert "not run by default" in planned["diffusers_native_math"]
    assert all("Hub" in planned[n] for n in planned if n.endswith("_hub"))
    # Named explicitly, math SDPA runs; an fp32 run refuses half-only kernels even on CUDA.
    assert dict(bench.plan(["diffusers_native_math"], cpu, fp32)) == {"diffusers_native_math": None}
    assert "bf16/fp16" in contenders.backend_problem("_native_flash", torch.device("cuda"), fp32)


def test_unknown_contender_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--contenders", "veomni,megatron"])
    err = capsys.readouterr().err
    assert "megatron" in err and "diffusers_native_cudnn" in err


@pytest.mark.slow
def test_fp32_contenders_match_step_for_step(tmp_path):
    out = tmp_path / "dit.json"
    names = "diffusers,veomni,veomni_kernels,veomni_keep_attention,diffusers_native_math,diffusers_native_cudnn"
    returned = bench.main([*SMOKE, "--precision", "fp32", "--contenders", names, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    for key in ("device", "versions", "commit", "config", "data", "settings", "flops", "ratios", "parity"):
        assert key in result
    assert {"torch", "diffusers"} <= set(result["versions"])
    assert result["data"]["tokens_per_sample"] == 3 * 4 * 4
    runs = result["contenders"]
    assert "CUDA" in runs["diffusers_native_cudnn"]["skipped"]
    base = runs["diffusers"]
    for name in ("diffusers", "veomni", "veomni_kernels", "veomni_keep_attention", "diffusers_native_math"):
        r = runs[name]
        assert "error" not in r, r.get("error")
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
        assert (
            r["samples_per_s"] > 0
            and len(r["step_s"]) == 2
            and r["trainable_params"] == base["trainable_params"]
        )
        assert r["param_dtypes"] == {"torch.float32": base["trainable_params"]}
        # fp32 throughout: anything beyond float rounding is a real mismatch.
        assert r["losses"][0] == pytest.approx(base["losses"][0], rel=1e-6)
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-5)
        assert r["grad_norms"] == pytest.approx(base["grad_norms"], rel=1e-4)
    assert base["losses"][2] != pytest.approx(base["losses"][0], rel=1e-3)  # the optimizer did step
    assert runs["veomni"]["build"].startswith("veomni build_model")
    # The kernels are bound (CPU defaults: diffusers' own RMSNorm / rotary code, veomni's sdpa attention).
    assert runs["veomni"]["ops"] is None
    assert runs["veomni_kernels"]["wan_ops"] == {"rms_norm": "eager", "rope": "eager", "attention": "sdpa"}
    assert result["parity"]["max_rel_diff_vs_diffusers"] < 1e-6
    assert result["ratios"]["veomni/diffusers"]["samples_per_s"] == pytest.approx(
        runs["veomni"]["samples_per_s"] / base["samples_per_s"]
    )
    assert "veomni" in result["target_t9"]


@pytest.mark.slow
def test_bf16_dtype_policy_is_the_same_on_both_sides(tmp_path):
    result = bench.main(
        [*SMOKE, "--steps", "1", "--contenders", "diffusers,veomni", "--out", str(tmp_path / "d.json")]
    )
    ours, theirs = result["contenders"]["veomni"], result["contenders"]["diffusers"]
    # bf16 parameters, except _keep_in_fp32_modules (norms, time embedder, scale-shift tables) in fp32 on both.
    assert ours["param_dtypes"] == theirs["param_dtypes"]
    assert set(ours["param_dtypes"]) == {"torch.bfloat16", "torch.float32"}
    assert ours["losses"][0] == pytest.approx(theirs["losses"][0], rel=1e-3)


@pytest.mark.slow
def test_compiled_contenders_trace_whole_blocks_and_match_eager(tmp_path):
    # aot_eager: dynamo must capture each block in one graph (fullgraph=True) and run it; inductor's code
    # generation is left to the GPU run.
    result = bench.main([
        *SMOKE, "--precision", "fp32", "--compile-backend", "aot_eager",
        "--contenders", "diffusers,veomni_compiled,diffusers_compiled", "--out", str(tmp_path / "c.json"),
    ])  # fmt: skip
    runs = result["contenders"]
    for name in ("veomni_compiled", "diffusers_compiled"):
        assert "error" not in runs[name], runs[name].get("error")
        assert runs[name]["compile_s"] > 0
        assert runs[name]["losses"] == pytest.approx(runs["diffusers"]["losses"], rel=1e-5)
    assert (
        runs["veomni_compiled"]["graphs_compiled"] >= 1
        and runs["veomni_compiled"]["recompiles_after_warmup"] == 0
    )


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_time_budget_skips_the_contenders_left_and_still_writes_json(tmp_path):
    out = tmp_path / "b.json"
    bench.main([*SMOKE, "--contenders", "diffusers,veomni", "--time-budget-s", "0", "--out", str(out)])
    runs = json.loads(out.read_text())["contenders"]
    assert set(runs) == {"diffusers", "veomni"}
    assert all("time budget" in r["skipped"] for r in runs.values())


def test_parity_reports_a_contender_whose_loss_is_nan(tmp_path):
    # diffusers first (its own difference, 0.0), then a contender gone NaN: Python's max would keep the 0.0.
    runs = {
        "diffusers": {"losses": [2.0]},
        "veomni": {"losses": [float("nan")]},
        "veomni_kernels": {"losses": [2.0]},
    }
    result = {"contenders": runs}
    bench._write(result, str(tmp_path / "p.json"))
    assert math.isnan(result["parity"]["max_rel_diff_vs_diffusers"])
    runs["veomni"]["losses"] = [2.2]
    bench._write(result, str(tmp_path / "p.json"))
    assert result["parity"]["max_rel_diff_vs_diffusers"] == pytest.approx(0.1)
