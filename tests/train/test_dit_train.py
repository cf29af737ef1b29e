"""The dit task through the trainer on the bundled quickstart-dit setup (tiny Wan transformer, tiny UMT5 / Wan VAE
built from configs, 48 synthetic clips): training steps, SP2 == SP1 through the trainer (gloo, fp32), exact
resume, FLOPs against torch's flop counter, the diffusers export, bad input, and the quickstart end to end with
its golden loss curve. Bad input (recipes, condition models, clips, frames, latent shards) is in
test_dit_inputs.py."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_offline_export import _train_save_export

from veomni.train.recipe import ASSETS_DIR, RecipeError, load_recipe, recipe_from_dict, recipe_to_dict

WanTransformer3DModel = pytest.importorskip("diffusers").WanTransformer3DModel
QUICKSTART = ASSETS_DIR / "quickstart_dit"
ROOT = Path(__file__).resolve().parents[2]


def dit_recipe(tmp: str, *, steps: int = 3, sp: int = 1, **train) -> dict:
    raw = recipe_to_dict(load_recipe("quickstart-dit"))
    raw["parallel"] = {"sp": sp}
    raw["train"].update({"steps": steps, "epochs": None, "log_interval": 1, **train})
    raw["optim"].update({"warmup_steps": 1})
    raw["checkpoint"].update({"dir": tmp, "resume": "never", "save_final": False, "hf_export": False})
    return raw


def _steps(ctx, raw: dict, n: int) -> list[dict[str, float]]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(dist_pools, tmp_path_factory) -> list[dict[str, float]]:
    """One process, 3 steps of the quickstart recipe (loss, grad norm, lr per step)."""
    raw = dit_recipe(str(tmp_path_factory.mktemp("ref")))
    return dist_pools.get(1, "gloo").run(_steps, raw, 3)[0]


def test_steps_are_finite_and_the_loss_falls(dist_pools, tmp_path):
    raw = dit_recipe(str(tmp_path), steps=12)
    raw["optim"].update({"lr": 3e-3, "schedule": "constant"})
    stats = dist_pools.get(1, "gloo").run(_steps, raw, 12)[0]
    losses = [s["loss"] for s in stats]
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in stats)
    assert np.mean(losses[-4:]) < 0.85 * np.mean(losses[:4]), losses


def _steps_and_block_runs(ctx, raw: dict, n: int) -> tuple[list[dict[str, float]], float]:
    """`_steps`, and how often the first block's feed-forward started per micro-batch: 2 when activation
    checkpointing recomputes the block in backward, else 1 (a pre-hook: the recomputation stops inside it)."""
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    ffn = next(m for name, m in run.model.named_modules() if name.endswith("blocks.0.ffn"))
    calls = []
    handle = ffn.register_forward_pre_hook(lambda *_: calls.append(1))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(n)]
    stats = [train_step(run, step) for step in steps]
    handle.remove()
    return stats, len(calls) / sum(len(step.micro_batches) for step in steps)


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_sp2_matches_one_process(dist_pools, reference, tmp_path, activation_checkpointing):
    # Every SP rank sees the same clips and noise; each computes the full loss / 2 and FSDP averages the gradient.
    raw = dit_recipe(str(tmp_path), sp=2)
    raw["parallel"]["activation_checkpointing"] = activation_checkpointing
    for rank_result, block_runs in dist_pools.get(2, "gloo").run(_steps_and_block_runs, raw, 3):
        assert block_runs == (2 if activation_checkpointing else 1)  # the recomputation under SP did run
        for got, want in zip(rank_result, reference, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            assert got["lr"] == want["lr"]


def _steps_with_ops(ctx, raw: dict, n: int) -> tuple[list[dict[str, float]], dict[str, str], set[str]]:
    from veomni.models.wan.kernels import bound_wan_ops
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    processors = {type(m.processor).__name__ for m in run.model.modules() if hasattr(m, "processor")}
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(n)], bound_wan_ops(run.model).names, processors


@pytest.mark.triton_cpu
def test_recipe_ops_bind_veomni_kernels_to_the_dit(dist_pools, reference, tmp_path):
    # ops reach diffusers' Wan attention (veomni.models.wan.kernels): Triton RMSNorm and interleaved rotary (through
    # the interpreter on CPU), veomni's eager attention; the fp32 steps equal the defaults' (diffusers' norm/rotary
    # code, sdpa).
    raw = dit_recipe(str(tmp_path))
    raw["ops"] = {"rms_norm": "triton", "rope": "triton", "attention": "eager", "compile": "off"}
    stats, names, processors = dist_pools.get(1, "gloo").run(_steps_with_ops, raw, 3)[0]
    assert names == {"rms_norm": "triton", "rope": "triton", "attention": "eager"}
    assert processors == {"WanKernelAttnProcessor"}
    for got, want in zip(stats, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def _resume(ctx, raw: dict, split: int, total: int) -> tuple[list[float], list[float]]:
    from veomni.train.loop import _save, build_run, train_step

    straight = build_run(recipe_from_dict(raw))
    it = iter(straight.train_data)
    want = [train_step(straight, next(it))["loss"] for _ in range(total)]
    first = build_run(recipe_from_dict(raw))
    it = iter(first.train_data)
    got = [train_step(first, next(it))["loss"] for _ in range(split)]
    _save(first)
    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed))
    assert second.step == split
    it = iter(second.train_data)
    got += [train_step(second, next(it))["loss"] for _ in range(total - split)]
    return want, got


def test_resume_is_exact(dist_pools, tmp_path):
    # Noise comes from each micro-batch's seed, the data position and optimizer state from the checkpoint.
    raw = dit_recipe(str(tmp_path), steps=4)
    want, got = dist_pools.get(1, "gloo").run(_resume, raw, 2, 4)[0]
    assert got == want


def _train_and_export(ctx, raw: dict, out: str) -> dict:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    for _ in range(2):
        train_step(run, next(it))
    run.task.export(run.model, Path(out), run.tokenizer, run.state)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in run.model.state_dict().items()}  # fmt: skip
    if ctx.rank != 0:
        return {}
    loaded = WanTransformer3DModel.from_pretrained(out)
    theirs = loaded.state_dict()
    return {
        "keys_equal": theirs.keys() == full.keys(),
        "equal": all(torch.equal(theirs[k], full[k]) for k in full),
        "config": json.loads((Path(out) / "config.json").read_text()),
        "init_keys": sorted(WanTransformer3DModel._get_init_keys(WanTransformer3DModel)),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_export_loads_in_diffusers_with_the_same_state_dict(dist_pools, tmp_path, world_size):
    # Two ranks: FSDP2-sharded (and SP2) parameters gathered into one diffusers checkpoint.
    raw = dit_recipe(str(tmp_path / "run"), sp=world_size)
    result = dist_pools.get(world_size, "gloo").run(_train_and_export, raw, str(tmp_path / "hf"))[0]
    assert result["keys_equal"] and result["equal"]
    config = result["config"]
    assert config["_class_name"] == "WanTransformer3DModel" and "_diffusers_version" in config
    assert set(config) - {"_class_name", "_diffusers_version"} <= set(result["init_keys"])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]


def test_offline_export_of_a_dit_checkpoint_equals_the_in_loop_one(dist_pools, tmp_path):
    # veomni-export-hf on step_N/dcp: the diffusers files the in-loop export writes, the trained config (overrides
    # included) taken from the checkpoint itself.
    from safetensors.torch import load_file

    from veomni.models.export.cli import main as export_cli

    raw = dit_recipe(str(tmp_path / "run"))
    raw["model"]["config_overrides"] = {"rope_max_seq_len": 64}
    step = Path(dist_pools.get(1, "gloo").run(_train_save_export, raw, str(tmp_path / "in_loop"))[0])
    assert export_cli([str(step / "dcp"), str(tmp_path / "offline"), "--prefix", "model."]) == 0
    in_loop, offline = tmp_path / "in_loop", tmp_path / "offline"
    assert sorted(p.name for p in offline.iterdir()) == sorted(p.name for p in in_loop.iterdir())
    config = json.loads((offline / "config.json").read_text())
    assert config == json.loads((in_loop / "config.json").read_text()) and config["rope_max_seq_len"] == 64
    want, got = (
        load_file(in_loop / "diffusion_pytorch_model.safetensors"),
        load_file(offline / "diffusion_pytorch_model.safetensors"),
    )
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    loaded = WanTransformer3DModel.from_pretrained(offline)
    assert loaded.config.rope_max_seq_len == 64
    # A text task named for a DiT checkpoint is refused, not silently ignored.
    from veomni.models.export.hf import export_dcp_to_hf

    with pytest.raises(
        ValueError, match=r"is a diffusers config \(WanTransformer3DModel\).*found task='causal_lm'"
    ):
        export_dcp_to_hf(step / "dcp", tmp_path / "refused", prefix="model.", task="causal_lm")


def test_flops_match_torch_flop_counter():
    """`DitFlops.sample` (from the family's weight counts) = 3 x the forward FLOPs torch's FlopCounterMode counts
    on one sample (matmuls, the patch convolution, attention), up to the biases and norms neither counts the same
    way."""
    from torch.utils.flop_counter import FlopCounterMode

    from veomni.models.diffusers.rules import find_diffusion_rules
    from veomni.models.family import resolve
    from veomni.train.tasks.dit import DitFlops

    config = WanTransformer3DModel.load_config(QUICKSTART / "transformer")
    torch.manual_seed(0)
    model = WanTransformer3DModel.from_config(config)
    text_len = 16
    hidden = torch.randn(1, 4, 2, 4, 6)  # 2 x 2 x 3 = 12 tokens
    with FlopCounterMode(display=False) as counter:
        model(hidden, torch.tensor([500.0]), torch.randn(1, text_len, 32))
    counts = resolve(find_diffusion_rules("WanTransformer3DModel").weight_counts)(model)
    ours = DitFlops.from_counts(counts, text_len, 0).sample(12)
    assert ours == pytest.approx(3 * counter.get_total_flops(), rel=1e-2)


def test_offline_embedding_resumes_and_trains_like_online(dist_pools, reference, tmp_path):
    out = tmp_path / "latents"
    cmd = [
        sys.executable,
        "-m",
        "veomni.train.dit_embed",
        "quickstart-dit",
        "--out",
        str(out),
        "--shard-size=16",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "48 samples in 3 shards" in first.stdout and "(3 encoded now" in first.stdout
    # Piped: no bar redraws, a plain line per shard.
    assert "\r" not in first.stderr
    assert "embed: 3/3 shards of rank 0 | elapsed " in first.stderr
    # Running again encodes just what is missing or cut short (a partial copy, a crash mid-write).
    (out / "shards" / "00001.safetensors").unlink()
    cut = out / "shards" / "00002.safetensors"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 3])
    (out / "latents.jsonl").unlink()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(2 encoded now" in again.stdout
    raw = dit_recipe(str(tmp_path / "run"))
    raw["data"].update({"kind": "dit_latents", "train_files": [str(out / "latents.jsonl")]})
    # Same seed: same micro-batches, noise and timesteps; the stored conditions equal the online ones up to the
    # text encoder's batch-size-dependent rounding (one prompt at a time offline, a micro-batch online).
    for got, want in zip(dist_pools.get(1, "gloo").run(_steps, raw, 3)[0], reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # Conditions encoded with other settings are refused.
    raw["dit"]["max_sequence_length"] = 32
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError"
    assert "dit.max_sequence_length: encoded with 16, recipe has 32" in message


def _pure_low_precision_steps(ctx, raw: dict, n: int) -> tuple[list[str], list[dict[str, float]]]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    dtypes = sorted({str(p.dtype) for p in run.model.parameters()})
    it = iter(run.train_data)
    return dtypes, [train_step(run, next(it)) for _ in range(n)]


def test_pure_bf16_trains_through_fsdp2(dist_pools, reference, tmp_path):
    # Low-precision storage under FSDP2: a Wan block's keep-fp32 parameters (scale_shift_table, the cross-attention
    # norm) would put two dtypes in one FSDP unit, which FSDP2 refuses at the first forward; they are stored in
    # bf16 there. The one-rank plain path keeps them in fp32.
    raw = dit_recipe(str(tmp_path), steps=2)
    raw["model"].update({"dtype": "bfloat16", "param_dtype": "bfloat16"})
    raw["parallel"]["force_fsdp2"] = True
    dtypes, stats = dist_pools.get(1, "gloo").run(_pure_low_precision_steps, raw, 2)[0]
    assert dtypes == ["torch.bfloat16"]
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in stats)
    assert stats[0]["loss"] == pytest.approx(reference[0]["loss"], rel=3e-2)  # the fp32 run's first loss


def _seen_timestep_and_rotary(ctx, raw: dict) -> dict:
    from veomni.core.parallel_state import use_parallel_state
    from veomni.train.loop import build_run

    run = build_run(recipe_from_dict(raw))
    modules = dict(run.model.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def timestep(module, args) -> None:
        seen.setdefault("timestep", args[0].detach().clone())

    def rope(module, args, out) -> None:
        seen.setdefault("rope", out[0].detach().clone())

    def attn_rotary(module, args, kwargs) -> None:
        # blocks.0.attn1 is no FSDP unit: its inputs are what block 0 received, after any cast of the block's.
        rotary = args[3] if len(args) > 3 else kwargs["rotary_emb"]
        seen.setdefault("attn_rotary", rotary[0].detach().clone())

    modules["condition_embedder.timesteps_proj"].register_forward_pre_hook(timestep)
    modules["rope"].register_forward_hook(rope)
    modules["blocks.0.attn1"].register_forward_pre_hook(attn_rotary, with_kwargs=True)
    batch = next(iter(run.train_data)).micro_batches[0]
    kwargs = run.task.model_kwargs(batch, run.device, torch.tensor(1))
    with use_parallel_state(run.state):
        run.model(**kwargs)
    # Plain values back to the driver (tensors would travel through shared memory).
    return {
        name: (str(t.dtype), t.double().tolist())
        for name, t in [("passed", kwargs["timestep"]), *seen.items()]
    }


@pytest.mark.parametrize("force_fsdp2", [True, False], ids=["fsdp2", "master_weights"])
def test_mixed_precision_keeps_the_timestep_and_rotary_tables_exact(dist_pools, tmp_path, force_fsdp2):
    # diffusers' pipelines hand the transformer float32 timesteps (its sinusoidal embedding is computed in float32)
    # and rotate in the rotary tables' own dtype. A bf16 cast of the inputs would train on timesteps rounded to bf16
    # (910.38 -> 912: a phase error of ~2 rad in the highest-frequency channels) and on bf16 rotary tables, which
    # inference never sees.
    raw = dit_recipe(str(tmp_path), steps=2)
    raw["model"].update({"dtype": "bfloat16", "param_dtype": "float32"})
    raw["parallel"]["force_fsdp2"] = force_fsdp2
    seen = dist_pools.get(1, "gloo").run(_seen_timestep_and_rotary, raw)[0]
    assert seen["passed"][0] == "torch.float32"
    assert seen["timestep"] == seen["passed"]
    assert seen["rope"][0] != "torch.bfloat16"
    assert seen["attn_rotary"] == seen["rope"]


def _build_error(ctx, raw: dict) -> tuple[str, str]:
    from veomni.train.loop import build_run

    try:
        build_run(recipe_from_dict(raw))
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err)
    return "no error", ""


def test_dit_recipe_rules():
    raw = recipe_to_dict(load_recipe("quickstart-dit"))
    bad = copy.deepcopy(raw)
    bad["train"].update({"tokens_per_step": 64, "tokens_per_micro_batch": 32})
    with pytest.raises(RecipeError, match="set one batch contract.*found both"):
        recipe_from_dict(bad)
    bad = copy.deepcopy(raw)
    bad["data"]["kind"] = "conversation"
    with pytest.raises(RecipeError, match="model.task='dit' with data.kind='conversation'"):
        recipe_from_dict(bad)
    text = recipe_to_dict(load_recipe("quickstart"))
    text["dit"] = {"shift": 5.0}
    with pytest.raises(RecipeError, match=r"dit: \['dit.shift'\] set, but model.task='text'"):
        recipe_from_dict(text)
    bad = copy.deepcopy(raw)
    bad["model"]["config"] = {"_class_name": "WanTransformer3DModel"}
    with pytest.raises(RecipeError, match="model.task=dit takes a diffusers config.json"):
        recipe_from_dict(bad)
    # The clip pipeline reads no token-pipeline field: one set would be ignored (on_bad_row=skip used to crash
    # after the model build, reading a bad-row index DitData does not have).
    bad = copy.deepcopy(raw)
    bad["data"].update({"on_bad_row": "skip", "max_seq_len": 4096})
    with pytest.raises(
        RecipeError,
        match=r"\['data.max_seq_len', 'data.on_bad_row'\] set, but model.task=dit does not read them",
    ):
        recipe_from_dict(bad)


# ---------------------------------------------------------------- quickstart


@pytest.mark.slow  # slow tier: the whole quickstart recipe through the CLI
def test_quickstart_dit_trains_and_exports_for_diffusers(tmp_path):
    out = tmp_path / "qs"
    cmd = [sys.executable, "-m", "veomni.train.cli", "quickstart-dit", f"--checkpoint.dir={out}"]
    # One intra-op thread: on a busy CI machine, thread barriers around these tiny tensors cost more than they
    # save (the loss curve does not depend on it).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:5])
    # The committed golden curve: same recipe, same data order, init and noise. CPU kernels may round
    # differently across machines, so the later steps get a looser bound.
    golden = json.loads((ROOT / "tests" / "golden" / "quickstart_dit_loss.json").read_text())["loss"]
    assert len(losses) == len(golden)
    assert losses[:5] == pytest.approx(golden[:5], rel=1e-3)
    assert losses == pytest.approx(golden, rel=5e-2)
    model = WanTransformer3DModel.from_pretrained(out / "hf")
    with torch.no_grad():
        sample = model(torch.randn(1, 4, 2, 4, 4), torch.tensor([10.0]), torch.randn(1, 16, 32)).sample
    assert sample.shape == (1, 4, 2, 4, 4) and torch.isfinite(sample).all()


def test_quickstart_dit_assets_are_what_the_script_writes(tmp_path):
    from PIL import Image

    # In process, as for the VLM assets: a fresh interpreter's imports (torch, diffusers, transformers) were most
    # of this test's time. The script seeds its own generators and leaves the global RNG alone.
    spec = importlib.util.spec_from_file_location(
        "make_quickstart_dit_data", ROOT / "tools" / "make_quickstart_dit_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    committed = sorted(p.relative_to(QUICKSTART) for p in QUICKSTART.rglob("*") if p.is_file())
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == fresh
    assert sum((QUICKSTART / p).stat().st_size for p in committed) < 1_000_000
    for name in committed:
        a, b = QUICKSTART / name, tmp_path / name
        if name.suffix == ".png":  # PNG bytes depend on the zlib build; the pixels must not
            assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b))), name
        else:
            assert a.read_bytes() == b.read_bytes(), (
                f"regenerate with tools/make_quickstart_dit_data.py: {name}"
            )


def test_resumes_exactly_from_a_checkpoint_saved_before_the_first_step(dist_pools, tmp_path):
    # No parameter of the DiT has AdamW state at step 0 (issue 42).
    from resume_helpers import check_exact_resume, resume_before_gradients

    (result,) = dist_pools.get(1, "gloo").run(
        resume_before_gradients, dit_recipe(str(tmp_path), steps=2), 0, 2
    )
    check_exact_resume(result, some="blocks")
