"""Tasks, freezing, lr multipliers and the hf backend: the trainer's seams for composite models.

Freezing and per-module learning rates run on real gloo ranks and must give the one-process result; frozen tensors
must come out of training bit-identical, with no optimizer state.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_loop import DENSE, MOE, initial_weights, tiny_recipe

from veomni.core.freeze import freeze_modules
from veomni.train.flops import query_width
from veomni.train.optim import lr_multiplier, param_groups
from veomni.train.preflight import PreflightError, check_trainable
from veomni.train.recipe import RecipeError, recipe_from_dict
from veomni.train.tasks import build_task
from veomni.train.tasks.text import TextTask

FROZEN = ["model.embed_tokens", "model.layers.0.self_attn"]
SCALED = {"model.layers.1": 0.5}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train_frozen(ctx, raw: dict, n: int) -> dict:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    params = dict(run.model.named_parameters())
    frozen = {k for k, p in params.items() if not p.requires_grad}
    before = {k: _full(p) for k, p in params.items()}
    it = iter(run.train_data)
    stats = [train_step(run, next(it)) for _ in range(n)]
    after = {k: _full(p) for k, p in params.items()}
    state_names = {name for g in run.optimizer.param_groups for name, p in zip(g["names"], g["params"], strict=True)
                   if p in run.optimizer.state}  # fmt: skip
    lrs = {g["lr_multiplier"]: g["lr"] for g in run.optimizer.param_groups}
    return {
        "stats": stats, "frozen": sorted(frozen), "with_state": sorted(state_names), "lrs": lrs,
        "unchanged": sorted(k for k in params if torch.equal(before[k], after[k])),
    }  # fmt: skip


@pytest.fixture(scope="module")
def frozen_weights(tmp_path_factory):
    return initial_weights(DENSE, str(tmp_path_factory.mktemp("frozen_init")))


def _frozen_recipe(tmp: str, weights: str) -> dict:
    raw = tiny_recipe(tmp, DENSE, weights=weights, steps=2)
    raw["model"]["freeze"] = list(FROZEN)
    raw["optim"]["lr_multipliers"] = dict(SCALED)
    return raw


def test_freezing_and_lr_multipliers_on_two_ranks_match_one_process(dist_pools, tmp_path, frozen_weights):
    one = dist_pools.get(1, "gloo").run(
        _train_frozen, _frozen_recipe(str(tmp_path / "a"), frozen_weights), 2
    )[0]
    two = dist_pools.get(2, "gloo").run(_train_frozen, _frozen_recipe(str(tmp_path / "b"), frozen_weights), 2)
    expected_frozen = sorted(
        ["model.embed_tokens.weight"]
        + [
            f"model.layers.0.self_attn.{m}.weight"
            for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ]
    )
    for result in (one, *two):
        assert result["frozen"] == expected_frozen
        assert result["unchanged"] == expected_frozen  # frozen: bit-identical; everything else moved
        assert not set(result["with_state"]) & set(expected_frozen)
        assert result["lrs"][0.5] == pytest.approx(0.5 * result["lrs"][1.0])
        for got, want in zip(result["stats"], one["stats"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            assert got["lr"] == want["lr"]  # the scheduled lr, not a multiplied group's


def _meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


def test_a_freeze_pattern_matching_nothing_names_it_and_the_modules():
    model = _meta_model(DENSE)
    with pytest.raises(
        ValueError,
        match=r"model\.freeze: \['visual'\] match no module.*top-level modules: \['model', 'lm_head'\]",
    ):
        freeze_modules(model, ["model.layers.0", "visual"], where="model.freeze")
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen when a pattern is bad


def test_freeze_by_module_glob_and_tied_weights(caplog):
    model = _meta_model({**DENSE, "tie_word_embeddings": True})
    with caplog.at_level("WARNING", logger="veomni.core"):
        frozen = freeze_modules(model, ["lm_head", "model.layers.*.mlp"])
    assert "model.embed_tokens.weight" in frozen  # tied to lm_head: one tensor, frozen under its name
    # ... which the user did not name: said, not silent.
    assert "['model.embed_tokens.weight'] frozen too: tied to a frozen parameter" in caplog.text
    assert {n for n in frozen if ".mlp." in n} == {
        f"model.layers.{i}.mlp.{m}_proj.weight" for i in range(2) for m in ("gate", "up", "down")
    }


def test_lr_multipliers_deepest_match_wins_and_errors_name_the_patterns():
    assert (
        lr_multiplier("model.layers.1.mlp.up_proj.weight", {"model.layers.*": 0.5, "model.layers.1.mlp": 2.0})
        == 2.0
    )
    assert lr_multiplier("model.norm.weight", {"model.layers.*": 0.5}) == 1.0
    with pytest.raises(ValueError, match="all match 'model.layers.1' with different values"):
        lr_multiplier("model.layers.1.mlp.up_proj.weight", {"model.layers.1": 0.5, "model.layers.*": 2.0})
    model = _meta_model(DENSE)
    with pytest.raises(ValueError, match=r"\['model.visual'\] match no parameter or module"):
        param_groups(model, 0.1, 1e-3, {"model.visual": 0.1})


def test_a_multiplier_on_a_frozen_module_is_said_not_refused(caplog):
    # quickstart-vlm's {model.visual: 0.01} with --model.freeze=[model.visual]: the multiplier has nothing left to
    # scale, which is an info line (issue 42), while a pattern matching nothing at all stays an error.
    model = _meta_model(DENSE)
    with caplog.at_level("INFO", logger="veomni.train"):
        check_trainable(model, ["model.norm"], {"model.norm": 0.1, "model.layers.*": 0.5})
    assert "['model.norm'] only match frozen parameters (model.freeze): no effect" in caplog.text
    assert {g["lr_multiplier"] for g in param_groups(model, 0.1, 1e-3, {"model.norm": 0.1})} == {1.0}
    with pytest.raises(PreflightError, match=r"\['model.nrom'\] match no parameter or module"):
        check_trainable(_meta_model(DENSE), ["model.norm"], {"model.nrom": 0.1})


def test_recipe_rejects_bad_multipliers_and_unknown_tasks(tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["optim"]["lr_multipliers"] = {"model.visual": "fast"}
    with pytest.raises(RecipeError, match=r"optim.lr_multipliers: expected numbers >= 0.*'fast'"):
        recipe_from_dict(raw)
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["model"]["task"] = "tts"
    with pytest.raises(RecipeError, match="model.task"):
        recipe_from_dict(raw)


def test_text_task_reads_the_language_model_config_of_a_composite():
    """A VLM-MoE keeps layers, heads and the router coefficient in text_config: the task must find them there."""
    from transformers import AutoConfig

    from veomni.train.loop import meta_instance

    config = AutoConfig.for_model(
        "qwen3_vl_moe",
        text_config={"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                     "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.03},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "deepstack_visual_indexes": []},
    )  # fmt: skip
    probe = meta_instance(config, "image_text_to_text")
    task = build_task("text", probe)
    assert isinstance(task, TextTask)
    assert (
        task.aux_loss_coef == 0.03 and task.num_layers == 3 and task.query_width == query_width(config) == 64
    )
    assert not hasattr(config, "router_aux_loss_coef") or config.router_aux_loss_coef != 0.03
    dense = build_task("text", meta_instance(_meta_model(DENSE).config))
    assert dense.aux_loss_coef == 0.0
    moe = build_task("text", meta_instance(_meta_model(MOE).config))
    assert moe.aux_loss_coef == 0.01
    with pytest.raises(
        ValueError,
        match=r"model.task: expected one of \['dit', 'dpo', 'omni', 'reward', 'text', 'vlm'\] or a task class as "
        r"'package.module:Class', found 'tts'",
    ):
        build_task("tts", probe)


def _first_losses(ctx, raw: dict, n: int) -> list[float]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it))["loss"] for _ in range(n)], type(run.model).__module__


def test_hf_backend_trains_upstream_class_with_the_same_loss(dist_pools, tmp_path, frozen_weights):
    pool = dist_pools.get(1, "gloo")
    raw = tiny_recipe(str(tmp_path / "v"), DENSE, weights=frozen_weights, steps=2)
    raw["model"].update({"dtype": "float32", "param_dtype": "float32"})
    raw["ops"] = {
        "attention": "eager",
        "cross_entropy": "eager",
        "rms_norm": "eager",
        "rope": "eager",
        "swiglu": "eager",
    }
    ours, ours_module = pool.run(_first_losses, raw, 2)[0]
    hf = copy.deepcopy(raw)
    hf["model"]["backend"] = "hf"
    hf["ops"] = {}
    hf["checkpoint"]["dir"] = str(tmp_path / "h")
    theirs, their_module = pool.run(_first_losses, hf, 2)[0]
    assert ours_module.startswith("veomni.") and their_module.startswith("transformers.")
    assert all(math.isfinite(x) for x in theirs)
    assert theirs == pytest.approx(ours, rel=1e-5)  # packed documents: HF masks them from position_ids
    hf["ops"] = {"rms_norm": "eager"}
    with pytest.raises(Exception, match=r"model.backend=hf .* ops sets \{'rms_norm': 'eager'\}"):
        pool.run(_first_losses, hf, 1)


def _config_of(ctx, raw: dict):
    from veomni.train.loop import model_config

    return model_config(recipe_from_dict(raw)).to_dict()


def test_config_overrides_apply_to_the_checkpoint_config_and_are_checked(tmp_path, frozen_weights):
    raw = tiny_recipe(str(tmp_path), DENSE, weights=frozen_weights)
    raw["model"]["config_overrides"] = {"attention_dropout": 0.0, "rms_norm_eps": 1e-5}
    config = _config_of(None, raw)
    assert config["rms_norm_eps"] == 1e-5 and config["num_hidden_layers"] == DENSE["num_hidden_layers"]
    raw["model"]["config_overrides"] = {"rms_norm_epsilon": 1e-5}
    with pytest.raises(
        Exception, match=r"(?s)model.config_overrides: .*'rms_norm_epsilon'.*did you mean 'rms_norm_eps'"
    ):
        _config_of(None, raw)
    inline = tiny_recipe(str(tmp_path), DENSE)
    inline["model"]["config_overrides"] = {"rms_norm_eps": 1e-5}
    with pytest.raises(RecipeError, match=r"model.config is an inline mapping; put \['rms_norm_eps'\] in it"):
        recipe_from_dict(inline)


def test_biases_are_not_decayed_nor_counted_as_matmuls_fused_expert_ones_included():
    # gpt-oss keeps its per-expert biases as [E, out] tensors: 2-D, yet additions, not matrices.
    from test_loop import GPT_OSS
    from transformers import AutoConfig

    from veomni.train.metrics import active_matmul_params
    from veomni.train.model_setup import meta_instance

    values = dict(GPT_OSS)
    probe = meta_instance(AutoConfig.for_model(values.pop("model_type"), **values), "causal_lm")
    decayed = {n for g in param_groups(probe, 0.1, 1.0) if g["weight_decay"] > 0 for n in g["names"]}
    assert "model.layers.0.mlp.experts.gate_up_proj" in decayed
    assert not [n for n in decayed if n.endswith("bias")]
    biases = sum(p.numel() for n, p in probe.named_parameters() if n.endswith("bias") and p.dim() >= 2)
    assert biases > 0
    with_biases = sum(
        p.numel() for n, p in probe.named_parameters() if p.dim() >= 2
    ) - probe.get_input_embeddings().weight.numel() * (0 if probe.config.tie_word_embeddings else 1)
    assert active_matmul_params(probe) == with_biases - biases


def test_step_flops_count_a_sliding_window_layer_over_its_window_only():
    """gpt-oss alternates sliding-window (128) and full layers: a query of a sliding layer attends to at most the
    window, so its attention FLOPs grow linearly beyond it; counting them as full causal attention overstates MFU
    (about 40 % for 32k-token samples of gpt-oss-20b)."""
    from transformers import AutoConfig

    from veomni.train.data import Step
    from veomni.train.loop import meta_instance

    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    task = build_task("text", meta_instance(config, "causal_lm"))
    lengths = (5, 8, 100)
    step = Step(step=0, epoch=0, micro_batches=[], tokens=sum(lengths), valid_tokens=1, sample_tokens=lengths)
    width = 4 * 16
    # Per sample, 6 * width * (s**2 on a full layer; on a sliding one s**2 up to the window, w * (2 s - w) beyond).
    full = sum(s * s for s in lengths)
    sliding = 5 * 5 + 8 * 8 + 8 * (2 * 100 - 8)
    expected = task.flops_per_token * step.tokens + 6.0 * width * (2 * full + 2 * sliding)
    assert task.step_flops(step) == pytest.approx(expected)


def test_the_mfu_peak_tells_the_h100_variants_apart():
    # torch.cuda.get_device_name's names; the PCIe and NVL parts run at lower clocks than the SXM one (dense bf16:
    # 756.5 and 835.5 against 989.4 TFLOP/s), and an SXM peak on them under-reports MFU by up to a quarter.
    from veomni.train.metrics import peak_flops, peak_flops_of

    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756.5e12
    assert peak_flops_of("NVIDIA H100 NVL") == 835.5e12
    assert peak_flops_of("NVIDIA H800 PCIe") == 756.5e12
    assert peak_flops_of("NVIDIA H200") == peak_flops_of("NVIDIA GH200 480GB") == 989.4e12
    assert peak_flops_of("NVIDIA H20") is None and peak_flops(torch.device("cpu")) is None


def _window_peaks(ctx, sizes_mib: list[int]) -> list[float]:
    """Each window's figure minus what was allocated before (other tests' tensors in this process)."""
    from veomni.train.metrics import window_peak_memory_gib

    device = ctx.device
    base = torch.cuda.memory_allocated(device) / 2**30
    peaks = []
    for size in sizes_mib:
        block = torch.empty(size * 2**20 // 4, dtype=torch.float32, device=device) if size else None
        del block
        peaks.append(window_peak_memory_gib(device) - base)
    return peaks


@pytest.mark.multi_gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_the_memory_figure_is_the_windows_peak_on_the_fullest_rank(dist_pools):
    # Before: rank 0's peak since the process started, so a window never showed less than the model load, and a
    # rank holding more (EP, uneven rows) was not seen. Rank 1 allocates 2 GiB in the first window, nothing after.
    results = dist_pools.get(2, "nccl").run(_window_peaks_per_rank, [[0, 0], [2048, 0]])
    for first, second in results:  # each rank's figure is the larger peak, less its own baseline
        assert first >= 1.9 and second < 0.5


def _window_peaks_per_rank(ctx, sizes_per_rank: list[list[int]]) -> list[float]:
    return _window_peaks(ctx, sizes_per_rank[ctx.rank])


@pytest.mark.cuda
def test_the_memory_figure_restarts_every_window():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from types import SimpleNamespace

    ctx = SimpleNamespace(device=torch.device("cuda", 0))
    first, second = _window_peaks(ctx, [1024, 0])
    assert first >= 1.0 and second < 0.5


def _matmul_weights(module: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if p.dim() >= 2 and not n.endswith("bias"))


def test_frozen_weights_count_forward_and_input_gradient_only_where_needed():
    # A frozen weight computes no weight gradient: 4 FLOPs per element and token when something trained runs before
    # it (the input gradient flows through it), 2 when nothing does. Before, every weight counted 6, so freezing
    # inflated MFU.
    from veomni.train.flops import flops_per_token

    full = flops_per_token(_meta_model(DENSE))
    model = _meta_model(DENSE)
    layer0 = _matmul_weights(model.model.layers[0])
    freeze_modules(model, ["model.layers.0"], where="test")
    assert flops_per_token(model) == full - 2 * layer0  # the trained embedding runs before it
    freeze_modules(model, ["model.embed_tokens"], where="test")
    assert flops_per_token(model) == full - 4 * layer0  # now nothing trained runs before it


def test_a_frozen_vision_tower_counts_its_forward_only():
    from transformers import AutoConfig

    from veomni.train.loop import meta_instance

    config = AutoConfig.for_model(
        "qwen3_vl",
        text_config={"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "deepstack_visual_indexes": []},
    )  # fmt: skip
    trained = build_task("vlm", meta_instance(config, "image_text_to_text"))
    probe = meta_instance(config, "image_text_to_text")
    freeze_modules(probe, ["model.visual"], where="test")
    frozen = build_task("vlm", probe)
    assert frozen.vision_flops_per_patch == pytest.approx(trained.vision_flops_per_patch / 3)
    # The language model's term is unchanged: the frozen tower runs before it, and it is not counted per token.
    assert frozen.flops_per_token == trained.flops_per_token


# Qwen3.5's text model, two Gated DeltaNet layers then one full-attention layer; value heads grouped 2:1.
HYBRID = dict(
    model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=88, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
)  # fmt: skip


def test_a_hybrid_counts_its_gated_delta_recurrence_per_token():
    # The chunked delta rule multiplies activations by activations (no weight sees it): before, MFU counted a Gated
    # DeltaNet layer by its projections alone. Per value head and token, forward 6 dk dv + 2 C (3 dk + 2 dv) at
    # C = 64: 6*8*12 + 128*(24 + 24) = 6720; x 8 heads x 2 layers x 3 (training).
    from veomni.train.flops import flops_per_token
    from veomni.train.metrics import matmul_flops_per_token

    model = _meta_model(HYBRID)
    assert flops_per_token(model) - matmul_flops_per_token(model) == 6720 * 8 * 2 * 3
    task = TextTask.for_model(model)
    assert task.num_layers == 1 and task.flops_per_token == flops_per_token(model)
    assert flops_per_token(_meta_model(DENSE)) == matmul_flops_per_token(_meta_model(DENSE))  # no such layers


def test_the_recurrence_term_matches_the_flop_counter_on_the_eager_kernel():
    # FlopCounterMode counts the eager oracle's matmuls (K K^T, Q K^T, (Q K^T) U, and the three state products);
    # it applies the chunk's triangular inverse by solves, which it does not count and fla multiplies out: the
    # term's 2 C (dk + dv) per value head and token. Two full chunks, so no chunk padding is counted.
    from torch.utils.flop_counter import FlopCounterMode

    from veomni.kernels.linear_attention.eager import gated_delta_rule_eager
    from veomni.train.flops import GATED_DELTA_CHUNK, gated_delta_rule_flops_per_token

    tokens, heads, value_heads, dk, dv, chunk = 128, 4, 8, 8, 12, GATED_DELTA_CHUNK
    q, k = torch.randn(1, tokens, heads, dk), torch.randn(1, tokens, heads, dk)
    v = torch.randn(1, tokens, value_heads, dv)
    g, beta = -torch.rand(1, tokens, value_heads), torch.rand(1, tokens, value_heads)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule_eager(q, k, v, g, beta, chunk_size=chunk)
    forward = gated_delta_rule_flops_per_token(_meta_model(HYBRID).config) / (3 * 2 * value_heads)
    assert counter.get_total_flops() == (forward - 2 * chunk * (dk + dv)) * value_heads * tokens
