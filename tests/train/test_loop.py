"""The training loop on real gloo ranks: every (dp, sp, ep) layout gives the single-process loss and grad norm per
step (dense, Qwen3-MoE, gpt-oss and GLM-4.5 MoE), resume is exact, and the quickstart trains, saves and exports a model plain transformers generates from."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from dist_harness import backend_params, gpu_count

from veomni.train.recipe import RecipeError, load_recipe, recipe_from_dict, recipe_to_dict

STEPS = 3
DENSE = {
    "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 192,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip
MOE = {
    "model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 192,
    "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": True,
}  # fmt: skip
# gpt-oss: sinks, alternating 16-token sliding / full layers (so SP shards cut through windows), biased clamped
# experts (moe_experts "torch", the clamped_* variants), biased router.
GPT_OSS = {
    "model_type": "gpt_oss", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 24,
    "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16, "max_position_embeddings": 512,
    "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.01, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip
# GLM-4.5 MoE: partial RoPE on an explicit head_dim, q/k norm, attention biases, a sigmoid router with groups (2 of
# 4 experts each, 1 kept), a shared expert, layer 0 dense.
GLM4_MOE = {
    "model_type": "glm4_moe", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5, "use_qk_norm": True,
    "attention_bias": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
MODELS = {"dense": DENSE, "moe": MOE, "gpt_oss": GPT_OSS, "glm4_moe": GLM4_MOE}
# Gemma 3 (text): 16-token sliding and full layers with their own RoPE bases, (1 + w) norms, a final soft-cap; for
# the async Ulysses test (its layouts are the conformance suite's SP cell).
GEMMA3 = {
    **DENSE, "model_type": "gemma3_text", "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
}  # fmt: skip


def initial_weights(model: dict, out: str) -> str:
    """An HF checkpoint of ``model`` saved by plain transformers: every layout starts from these same weights
    (a from-scratch init draws through DTensor's RNG and so depends on the sharding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(model)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def tiny_recipe(tmp: str, model: dict, *, weights: str | None = None, dp_replicate: int = 1, sp: int = 1,
                ep: int = 1, **train) -> dict:  # fmt: skip
    raw = recipe_to_dict(load_recipe("quickstart"))
    raw["model"]["config"] = None if weights else copy.deepcopy(model)
    raw["model"]["weights"] = weights
    raw["parallel"] = {"dp_replicate": dp_replicate, "sp": sp, "ep": ep}
    raw["train"].update({"tokens_per_step": 1024, "tokens_per_micro_batch": 256, "steps": STEPS, "epochs": None,
                         "eval_interval": None, "log_interval": 1, **train})  # fmt: skip
    raw["optim"].update({"warmup_steps": 1})
    raw["ops"] = {"moe_experts": "torch"} if model is not DENSE else {}
    if model is MOE:
        # A fused linear-cross-entropy reads lm_head.weight without calling the head, which is an FSDP unit of its
        # own (untied): the portable fused kernel runs that path on every layout.
        raw["ops"]["cross_entropy"] = "chunk_loss"
    raw["checkpoint"].update({"dir": tmp, "resume": "never", "save_final": False, "hf_export": False})
    raw["data"]["eval_files"] = []
    return raw


def _steps(ctx, raw: dict, n: int) -> list[dict[str, float]]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(n)]


def _recomputed_steps(ctx, raw: dict, n: int) -> tuple[list[dict[str, float]], float]:
    """`_steps`, and how often the first block's MLP started per micro-batch: 1, or 2 when activation checkpointing
    recomputes the block in backward (a layout run "with checkpointing" that never recomputed proves nothing). A
    pre-hook: the recomputation stops as soon as it has rebuilt what backward needs, inside the MLP's forward."""
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    mlp = next(m for name, m in run.model.named_modules() if name.endswith("layers.0.mlp"))
    calls = []
    handle = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    steps = [next(it) for _ in range(n)]
    stats = [train_step(run, step) for step in steps]
    handle.remove()
    return stats, len(calls) / sum(len(step.micro_batches) for step in steps)


LAYOUTS = {  # world -> [(dp_replicate, sp, ep)] ; dp_shard fills the rest
    # (1, 1, 1): plain FSDP, every parameter sharded over both ranks (for the MoE models without EP, so the experts
    # are FSDP-sharded as well).
    2: [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(2, 2, 1), (2, 1, 2), (1, 2, 2)],
}
# Layouts also run with activation checkpointing: the recomputation in backward must see the same SP/EP state.
CHECKPOINTED = {(1, 2, 1), (1, 2, 2)}


@pytest.fixture(scope="module")
def references(dist_pools, tmp_path_factory):
    """Per model: its initial weights and the single-process (loss, grad norm, lr) of each step."""
    pool = dist_pools.get(1, "gloo")
    out = {}
    for name, model in MODELS.items():
        weights = initial_weights(model, str(tmp_path_factory.mktemp(f"{name}_init")))
        raw = tiny_recipe(str(tmp_path_factory.mktemp(name)), model, weights=weights)
        out[name] = (weights, pool.run(_steps, raw, STEPS)[0])
    return out


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_every_layout_matches_one_process(dist_pools, references, tmp_path, world_size, backend, model_name):
    model = MODELS[model_name]
    if model is GPT_OSS and world_size != 2:
        pytest.skip("gpt_oss runs the 2-rank layouts; the 4-rank ones add no gpt-oss-specific path")
    pool = dist_pools.get(world_size, backend)
    weights, reference = references[model_name]
    for dp_replicate, sp, ep in LAYOUTS[world_size]:
        if model is DENSE and ep > 1:
            continue
        raw = tiny_recipe(
            str(tmp_path / f"{dp_replicate}{sp}{ep}"),
            model,
            weights=weights,
            dp_replicate=dp_replicate,
            sp=sp,
            ep=ep,
        )
        # On NCCL the same weights and data run on GPUs and are compared with the CPU reference (no TF32).
        tol = {"loss": 2e-5, "grad_norm": 1e-4} if backend == "gloo" else {"loss": 1e-4, "grad_norm": 1e-3}
        if backend == "nccl":
            raw["train"]["device"] = "cuda"
        checkpointed = (dp_replicate, sp, ep) in CHECKPOINTED and model is not GPT_OSS
        # "keep": checkpointing that keeps the attention outputs (the dense model stands for the rest).
        acs = (False, True, "keep") if model is DENSE else (False, True)
        for ac in acs if checkpointed else (False,):
            raw["parallel"]["activation_checkpointing"] = bool(ac)
            raw["parallel"]["ac_keep_attention"] = ac == "keep"
            for rank_result, block_runs in pool.run(_recomputed_steps, raw, STEPS):
                layout = f"dp_replicate={dp_replicate} sp={sp} ep={ep} activation_checkpointing={ac}"
                if backend == "gloo":  # CUDA compiles the blocks: a Python hook inside one is not a reliable counter
                    assert block_runs == (2 if ac else 1), layout
                for got, want in zip(rank_result, reference, strict=True):
                    assert got["loss"] == pytest.approx(want["loss"], rel=tol["loss"]), layout
                    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=tol["grad_norm"]), layout
                    assert got["lr"] == want["lr"]


def _resume(ctx, raw: dict, split: int, total: int) -> tuple[list[float], list[float]]:
    from veomni.train.loop import _save, build_run, train_step

    straight = build_run(recipe_from_dict(raw))
    it = iter(straight.train_data)
    want = [train_step(straight, next(it))["loss"] for _ in range(total)]

    first = build_run(recipe_from_dict(raw))
    it = iter(first.train_data)
    got = [train_step(first, next(it))["loss"] for _ in range(split)]
    _save(first)
    resumed_raw = copy.deepcopy(raw)
    resumed_raw["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed_raw))
    assert second.step == split
    it = iter(second.train_data)
    got += [train_step(second, next(it))["loss"] for _ in range(total - split)]
    return want, got


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2))
def test_resume_is_exact(dist_pools, tmp_path, world_size, backend):
    raw = tiny_recipe(str(tmp_path), DENSE, steps=4)
    if backend == "nccl":
        raw["train"]["device"] = "cuda"
    for want, got in dist_pools.get(world_size, backend).run(_resume, raw, 2, 4):
        assert got == want  # bitwise: same data, same RNG, same optimizer state


@pytest.mark.slow  # slow tier: the whole quickstart recipe through the CLI
def test_quickstart_trains_saves_and_exports(tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "qs"
    cmd = [sys.executable, "-m", "veomni.train.cli", "quickstart", f"--checkpoint.dir={out}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step " in result.stdout and "lr " in result.stdout
    # Redirected output (not a terminal): no progress-bar redraws, and each metric line carries the wall-clock
    # time, the elapsed time and the ETA instead.
    assert "\r" not in result.stderr and "\r" not in result.stdout
    metric_lines = [line for line in result.stdout.splitlines() if " | grad " in line]
    assert metric_lines
    for line in metric_lines:
        assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] step \d+/\d+ \| .* \| elapsed \w+ \| eta \w+", line), line
    first, last = (
        float(x) for x in re.search(r"done: \d+ steps, loss (\S+) -> (\S+)", result.stdout).groups()
    )
    assert last < first * 0.5
    # The committed golden curve (tests/golden/quickstart_loss.json): same recipe, same data order and init.
    # CPU kernels may round differently across machines, so the later steps get a looser bound.
    golden = json.loads((Path(__file__).parents[1] / "golden" / "quickstart_loss.json").read_text())["loss"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == len(golden)
    assert losses[:5] == pytest.approx(golden[:5], rel=1e-3)
    assert losses == pytest.approx(golden, rel=5e-2)
    assert (out / "recipe.yaml").is_file()
    assert any((p / "COMPLETE").is_file() for p in out.glob("step_*"))
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > ids.shape[1]


def _train_and_save(ctx, raw: dict, n: int) -> None:
    from veomni.train.loop import _save, build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    for _ in range(n):
        train_step(run, next(it))
    _save(run)


def _resume_and_step(ctx, raw: dict) -> tuple[int, dict[str, float]]:
    from veomni.train.loop import build_run, train_step

    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    run = build_run(recipe_from_dict(resumed))
    return run.step, train_step(run, next(iter(run.train_data)))


def test_resume_on_another_world_size_continues_the_same_run(dist_pools, references, tmp_path):
    # Two steps on 2 ranks (FSDP over 2), then resume on 1 rank: model, optimizer, schedule and data position
    # carry over, so step 3 is the single-process run's step 3 (up to reduction order).
    weights, reference = references["dense"]
    raw = tiny_recipe(str(tmp_path), DENSE, weights=weights)
    dist_pools.get(2, "gloo").run(_train_and_save, raw, 2)
    step, stats = dist_pools.get(1, "gloo").run(_resume_and_step, raw)[0]
    assert step == 2
    assert stats["loss"] == pytest.approx(reference[2]["loss"], rel=2e-5)
    assert stats["grad_norm"] == pytest.approx(reference[2]["grad_norm"], rel=1e-4)
    assert stats["lr"] == reference[2]["lr"]


def _train_counting_saves(ctx, raw: dict) -> list[int]:
    from veomni.train.checkpoint import CheckpointManager
    from veomni.train.loop import train

    saved, original = [], CheckpointManager.save

    def counting(self, step, *args, **kwargs):
        saved.append(step)
        return original(self, step, *args, **kwargs)

    CheckpointManager.save = counting
    try:
        train(recipe_from_dict(raw))
    finally:
        CheckpointManager.save = original
    return saved


def test_the_last_step_is_saved_once(dist_pools, tmp_path):
    # An interval that divides the run saves its last step in the loop: save_final must not write it again (a
    # rewrite is wasted time, and was once a window with no complete checkpoint), nor after a resume at the end.
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["checkpoint"].update({"interval": STEPS, "save_final": True, "keep_last": 1})
    pool = dist_pools.get(1, "gloo")
    assert pool.run(_train_counting_saves, raw)[0] == [STEPS]
    raw["checkpoint"]["resume"] = "auto"
    assert pool.run(_train_counting_saves, raw)[0] == []
    raw["checkpoint"]["interval"] = 2  # not a divisor: the final save is the only one of the last step
    raw["checkpoint"]["resume"] = "never"
    raw["checkpoint"]["dir"] = str(tmp_path / "again")
    assert pool.run(_train_counting_saves, raw)[0] == [2, STEPS]


def _step_flops_and_local_lengths(ctx, raw: dict) -> tuple[float, list[int], float]:
    import torch.distributed as dist

    from veomni.train.loop import build_run
    from veomni.train.metrics import attention_flops

    run = build_run(recipe_from_dict(raw))
    step = next(iter(run.train_data))
    mine = [
        int(b - a)
        for batch in step.micro_batches
        for a, b in zip(batch["cu_seqlens"][:-1], batch["cu_seqlens"][1:], strict=True)
    ]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    want = run.task.flops_per_token * step.tokens + attention_flops(
        [n for lengths in every for n in lengths], run.task.num_layers, run.task.query_width
    )
    return run.task.step_flops(step), sorted(step.sample_tokens), want


def test_step_flops_count_the_attention_of_every_dp_rank(dist_pools, tmp_path):
    # The MFU numerator is the whole step's FLOPs (the loop divides by the world size): the attention term too,
    # not only this rank's samples.
    results = dist_pools.get(2, "gloo").run(_step_flops_and_local_lengths, tiny_recipe(str(tmp_path), DENSE))
    for flops, _, want in results:
        assert flops == pytest.approx(want, rel=1e-12)
    assert results[0][:2] == results[1][:2]


def test_a_resume_with_other_optimizer_hyperparameters_says_which_keep_their_saved_values(tmp_path, caplog):
    from veomni.train.checkpoint.match import check_resumable

    saved = recipe_to_dict(recipe_from_dict(tiny_recipe(str(tmp_path), DENSE)))
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["optim"].update({"lr": saved["optim"]["lr"] * 2, "warmup_steps": 3})
    with caplog.at_level("WARNING", logger="veomni.train"):
        check_resumable(tmp_path, {"recipe": saved}, model_config={}, recipe=recipe_to_dict(recipe_from_dict(raw)))
    (message,) = [r.getMessage() for r in caplog.records if "optimizer and schedule state" in r.getMessage()]
    assert f"optim.lr: saved {saved['optim']['lr']!r}, recipe {raw['optim']['lr']!r}" in message
    assert (
        "warmup" not in message.split("keep the saved values of")[1].split("(the")[0]
    )  # the recipe's, no warning


BF16_LAYOUTS = [(1, 1, 1), (4, 1, 1), (2, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
# bf16 tolerances against the one-GPU bf16 run. Step 0 sees identical weights, so only the order of bf16/fp32
# reductions differs (sharded gradient sums, SP attention heads, EP token groupings); later steps also carry
# AdamW's amplification of those rounding differences (near-zero gradients give sign-like updates). Measured on
# 4 x H200 (notebook/runs/2026-11-22-bf16-grid-4xh200.txt): at most 9.7e-7 / 4.2e-5 / 9.3e-4; about 10x margin here.
BF16_TOL = {"loss0": 1e-4, "loss": 1e-3, "grad_norm": 1e-2}


@pytest.mark.multi_gpu
@pytest.mark.skipif(gpu_count() < 4, reason="needs 4 CUDA GPUs")
@pytest.mark.parametrize("model_name", ["dense", "moe"])
def test_bf16_layouts_on_four_gpus_match_one_gpu(dist_pools, tmp_path, model_name):
    """The (dp, sp, ep) grid in bf16 compute (fp32 masters) on 4 GPUs over NCCL vs the same recipe on one GPU."""
    model = DENSE if model_name == "dense" else MOE
    weights = initial_weights(model, str(tmp_path / "init"))

    def recipe(name: str, dp_replicate: int, sp: int, ep: int) -> dict:
        raw = tiny_recipe(
            str(tmp_path / name), model, weights=weights, dp_replicate=dp_replicate, sp=sp, ep=ep
        )
        raw["model"]["dtype"] = "bfloat16"
        raw["train"]["device"] = "cuda"
        return raw

    reference = dist_pools.get(1, "nccl").run(_steps, recipe("ref", 1, 1, 1), STEPS)[0]
    pool = dist_pools.get(4, "nccl")
    for dp_replicate, sp, ep in BF16_LAYOUTS:
        if model is DENSE and ep > 1:
            continue
        layout = f"{model_name} dp_replicate={dp_replicate} sp={sp} ep={ep}"
        for rank, rank_result in enumerate(
            pool.run(_steps, recipe(f"{dp_replicate}{sp}{ep}", dp_replicate, sp, ep), STEPS)
        ):
            deviations = [
                (abs(g["loss"] / w["loss"] - 1), abs(g["grad_norm"] / w["grad_norm"] - 1))
                for g, w in zip(rank_result, reference, strict=True)
            ]
            if rank == 0:  # every rank reports the same all-reduced figures
                print(f"bf16 grid {layout}: relative (loss, grad_norm) deviation per step {deviations}")
            assert deviations[0][0] <= BF16_TOL["loss0"], layout
            assert all(d[0] <= BF16_TOL["loss"] for d in deviations), layout
            assert all(d[1] <= BF16_TOL["grad_norm"] for d in deviations), layout


def _pure_bf16_run(ctx, raw: dict) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    stats = [train_step(run, next(it)) for _ in range(STEPS)]
    states = [s for group in run.optimizer.state.values() for s in group.values() if torch.is_tensor(s)]
    return {
        "fsdp": isinstance(run.model, FSDPModule),
        "param_dtypes": sorted({str(p.dtype) for p in run.model.parameters()}),
        "state_dtypes": sorted({str(s.dtype) for s in states if s.dim() > 0}),
        "stats": stats,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_pure_bf16_trains_in_bf16(dist_pools, references, tmp_path, world_size):
    """param_dtype = dtype = bf16: bf16 parameters and AdamW state, losses that follow the fp32 run to bf16
    accuracy; one rank is a plain module (no FSDP2 hooks), two ranks shard without mixed precision."""
    weights, reference = references["dense"]
    raw = tiny_recipe(str(tmp_path), DENSE, weights=weights)
    raw["model"].update({"dtype": "bfloat16", "param_dtype": "bfloat16"})
    got = dist_pools.get(world_size, "gloo").run(_pure_bf16_run, raw)[0]
    assert got["fsdp"] == (world_size > 1)
    assert got["param_dtypes"] == ["torch.bfloat16"]
    assert got["state_dtypes"] == ["torch.bfloat16"]
    for step, want in zip(got["stats"], reference, strict=True):
        assert step["loss"] == pytest.approx(want["loss"], rel=2e-2)
        assert step["lr"] == want["lr"]


def test_steps_stay_on_the_device_until_read(tmp_path):
    """The loop's step hands back device tensors (no host read per step); `read_stats` reads a whole window at
    once and gives what `train_step` gives."""
    from veomni.train.loop import build_run
    from veomni.train.step import read_stats, train_step, train_step_on_device

    raw = tiny_recipe(str(tmp_path / "a"), DENSE, steps=3)
    first, second = build_run(recipe_from_dict(raw)), build_run(recipe_from_dict(raw))
    it_a, it_b = iter(first.train_data), iter(second.train_data)
    lazy = [train_step_on_device(first, next(it_a)) for _ in range(3)]
    assert all(isinstance(s["loss"], torch.Tensor) and isinstance(s["grad_norm"], torch.Tensor) for s in lazy)
    read = read_stats(lazy)
    eager = [train_step(second, next(it_b)) for _ in range(3)]
    assert read == eager and all(isinstance(s["loss"], float) for s in read)


def _async_vs_sync(ctx, raw: dict, n: int) -> list[tuple[dict, dict]]:
    import copy

    from veomni.train.loop import build_run, train_step

    out = []
    runs = []
    for flag in (False, True):
        cfg = copy.deepcopy(raw)
        cfg["parallel"]["async_ulysses"] = flag
        cfg["checkpoint"]["dir"] = f"{raw['checkpoint']['dir']}/{flag}"
        runs.append(build_run(recipe_from_dict(cfg)))
    sync_run, async_run = runs
    enabled = sum(bool(getattr(m, "veomni_async_ulysses", False)) for m in async_run.model.modules())
    it_s, it_a = iter(sync_run.train_data), iter(async_run.train_data)
    for _ in range(n):
        out.append((train_step(sync_run, next(it_s)), train_step(async_run, next(it_a))))
    return enabled, out


@pytest.mark.parametrize("model_name", ["dense", "moe", "glm4_moe", "gemma3"])
def test_async_ulysses_trains_like_the_sync_path(dist_pools, tmp_path, model_name):
    """parallel.async_ulysses on SP2 (gloo): the same losses and grad norms as the synchronous exchange, with
    activation checkpointing (the recompute takes the async path again)."""
    model = {**MODELS, "gemma3": GEMMA3}[model_name]
    weights = initial_weights(model, str(tmp_path / "init"))
    raw = tiny_recipe(str(tmp_path), model, weights=weights, sp=2)
    raw["parallel"]["activation_checkpointing"] = True
    enabled, steps = dist_pools.get(2, "gloo").run(_async_vs_sync, raw, STEPS)[0]
    assert enabled == model["num_hidden_layers"]
    for sync, fast in steps:
        assert fast["loss"] == pytest.approx(sync["loss"], rel=1e-6)
        assert fast["grad_norm"] == pytest.approx(sync["grad_norm"], rel=1e-5)
    no_sp = tiny_recipe(str(tmp_path / "x"), model)
    no_sp["parallel"]["async_ulysses"] = True
    with pytest.raises(RecipeError, match="parallel.async_ulysses: true overlaps the Ulysses exchange, but"):
        recipe_from_dict(no_sp)


def test_async_ulysses_is_refused_before_the_build_with_the_familys_reason(tmp_path):
    """A model type whose family declares no async branch is refused before anything is built, naming why."""
    from veomni.train.model_setup import _async_ulysses_type, model_config
    from veomni.train.preflight import PreflightError

    raw = tiny_recipe(str(tmp_path), GPT_OSS, sp=2)
    raw["parallel"]["async_ulysses"] = True
    recipe = recipe_from_dict(raw)
    refused = r"'gpt_oss' \(family 'gpt_oss'\) has no async Ulysses path: GptOss"
    with pytest.raises(PreflightError, match=refused):
        _async_ulysses_type(recipe, model_config(recipe))
    raw = tiny_recipe(str(tmp_path), GEMMA3, sp=2)
    raw["parallel"]["async_ulysses"] = True
    recipe = recipe_from_dict(raw)
    assert _async_ulysses_type(recipe, model_config(recipe)) == "gemma3_text"


@pytest.mark.parametrize("feature", ["async_ulysses", "ac_keep_attention"])
def test_eager_only_features_keep_blocks_eager_where_compile_would_trace_them(tmp_path, feature):
    """Compiled blocks can trace neither the async_op=True all-to-alls nor checkpointing that selects the attention
    call inside a block: compile 'auto' on CUDA becomes 'off' for those features (backend choices kept), an explicit
    'on' is refused, CPU (auto = off) is untouched."""
    from veomni.kernels import Hardware, OpsConfig
    from veomni.train.model_setup import ops_for_eager_only_features
    from veomni.train.preflight import PreflightError

    raw = tiny_recipe(str(tmp_path), DENSE, sp=2)
    raw["parallel"]["activation_checkpointing"] = feature == "ac_keep_attention"
    raw["parallel"][feature] = True
    recipe = recipe_from_dict(raw)
    h100 = Hardware(device_type="cuda", capability=(9, 0))
    auto = OpsConfig(hardware=h100)
    eager = ops_for_eager_only_features(recipe, auto)
    assert auto.compile_enabled and not eager.compile_enabled
    assert (eager.attention, eager.rms_norm, eager.defaulted) == (
        auto.attention,
        auto.rms_norm,
        auto.defaulted,
    )
    with pytest.raises(PreflightError, match=f"parallel.{feature}: true .* but ops.compile is 'on'"):
        ops_for_eager_only_features(recipe, OpsConfig(hardware=h100, compile="on"))
    cpu = OpsConfig(hardware=Hardware(device_type="cpu"))
    assert ops_for_eager_only_features(recipe, cpu) is cpu
    raw["parallel"][feature] = False
    assert ops_for_eager_only_features(recipe_from_dict(raw), auto) is auto
