"""The linear-attention hybrids (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE text models) in the text trainer on real gloo
ranks: the (dp, sp, ep) grid gives the single-process loss and grad norm per step (Gated DeltaNet under Ulysses SP
over heads, experts under EP, packed rows throughout), and a DCP checkpoint resumes and exports to a
plain-transformers checkpoint that generates what veomni's own model generates from it.

On CPU the Gated DeltaNet ops default to the eager oracles (fla is CUDA-only); transformers is only used to write
the initial weights and to read and run the export.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_loop import initial_weights, tiny_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 2
# Shared by the three: 2 Gated DeltaNet layers then 1 gated full-attention layer; 4 key / 8 value linear heads and
# 4 query / 2 kv attention heads, so SP=2 splits every head group; partial RoPE (a quarter of head_dim). Widths are
# multiples of 4 (the 'torch' grouped GEMM), and unlike one another so a swapped dimension cannot line up.
_HYBRID = {
    "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
# Qwen3.5's RoPE is multimodal (interleaved T/H/W sections) even in the text model; text positions are the same in
# all three sections, and the sections cover the 2 rotary frequencies of a 4-wide rotary slice.
_QWEN3_5_ROPE = {
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
    "mrope_interleaved": True,
}  # fmt: skip
_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention"]
_ROUTER = {"output_router_logits": True, "router_aux_loss_coef": 0.01}
HYBRIDS: dict[str, dict] = {
    # layer 0 dense, then routed + shared experts (full_attention_interval builds the layer types).
    "qwen3_next": {
        "model_type": "qwen3_next", **_HYBRID, "intermediate_size": 96, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "full_attention_interval": 3, "mlp_only_layers": [0], "partial_rotary_factor": 0.25, **_ROUTER,
    },
    "qwen3_5_text": {
        "model_type": "qwen3_5_text", **_HYBRID, "intermediate_size": 88, "layer_types": _LAYER_TYPES,
        "rope_parameters": _QWEN3_5_ROPE,
    },
    # every layer routed + shared experts (Qwen3.5-MoE has no dense layers).
    "qwen3_5_moe_text": {
        "model_type": "qwen3_5_moe_text", **_HYBRID, "moe_intermediate_size": 20,
        "shared_expert_intermediate_size": 36, "num_experts": 8, "num_experts_per_tok": 2,
        "layer_types": _LAYER_TYPES, "rope_parameters": _QWEN3_5_ROPE, **_ROUTER,
    },
}  # fmt: skip
MOES = {"qwen3_next", "qwen3_5_moe_text"}
LAYOUTS = [(1, 2, 1), (1, 1, 2), (1, 2, 2)]  # (dp_replicate, sp, ep) on 2 ranks; dp_shard fills the rest
# The dense model has no EP: plain FSDP over both ranks takes the place of the EP layouts' 2-way data split.
DENSE_LAYOUTS = [(1, 2, 1), (1, 1, 1)]


def hybrid_recipe(tmp: str, name: str, weights: str, *, sp: int = 1, ep: int = 1, **train) -> dict:
    """The raw recipe of ``HYBRIDS[name]`` from the HF checkpoint ``weights``, ``STEPS`` steps.

    512 tokens a step (``train`` overrides it): still two packed 256-token micro-batches on one process, so gradient
    accumulation and document boundaries are in play, at half the CPU time of test_loop's 1024.
    """
    train = {"tokens_per_step": 512, **train}
    raw = tiny_recipe(tmp, HYBRIDS[name], weights=weights, sp=sp, ep=ep, steps=STEPS, **train)
    raw["ops"] = {"moe_experts": "torch"} if name in MOES else {}
    return raw


def _steps(ctx, raw: dict) -> list[dict[str, float]]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def references(dist_pools, tmp_path_factory):
    """Per model, built on first use: its initial weights and the single-process (loss, grad norm) of each step."""
    cache: dict[str, tuple[str, list[dict[str, float]]]] = {}

    def get(name: str) -> tuple[str, list[dict[str, float]]]:
        if name not in cache:
            weights = initial_weights(HYBRIDS[name], str(tmp_path_factory.mktemp(f"{name}_init")))
            raw = hybrid_recipe(str(tmp_path_factory.mktemp(f"{name}_ref")), name, weights)
            cache[name] = (weights, dist_pools.get(1, "gloo").run(_steps, raw)[0])
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_every_layout_matches_one_process(dist_pools, references, tmp_path, name):
    weights, reference = references(name)
    pool = dist_pools.get(2, "gloo")
    for dp_replicate, sp, ep in LAYOUTS if name in MOES else DENSE_LAYOUTS:
        raw = hybrid_recipe(str(tmp_path / f"{dp_replicate}{sp}{ep}"), name, weights, sp=sp, ep=ep)
        for stats in pool.run(_steps, raw):
            layout = f"{name} dp_replicate={dp_replicate} sp={sp} ep={ep}"
            for got, want in zip(stats, reference, strict=True):
                assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), layout
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), layout


def _save(ctx, raw: dict) -> None:
    from veomni.train.loop import _export, _save, build_run, train_step

    run = build_run(recipe_from_dict(raw))
    train_step(run, next(iter(run.train_data)))
    # The trained weights as the saving run holds them: what the resumed run must hold again, bit for bit.
    _export(run, "trained")
    _save(run)


def _resume_and_export(ctx, raw: dict) -> int:
    from veomni.train.loop import _export, build_run

    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    run = build_run(recipe_from_dict(resumed))
    _export(run, "hf")
    return run.step


@pytest.fixture
def gdn_decoding_on_torch(monkeypatch):
    # Cached decoding (transformers' and veomni's generated copy of it alike) sends the Gated DeltaNet and the short
    # convolution to fla / causal-conv1d whenever they are installed, which are CUDA-only; the export runs here on
    # CPU tensors (also on a GPU host), so point both at the torch functions they wrap.
    import importlib

    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        for module_name in (f"transformers.models.{family}.modeling_{family}",
                            f"veomni.models.{family}.generated.patched_modeling_{family}"):  # fmt: skip
            module = importlib.import_module(module_name)
            for fn_name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                            "causal_conv1d_update"):  # fmt: skip
                fn = getattr(module, fn_name)
                monkeypatch.setattr(module, fn_name, getattr(fn, "__wrapped__", fn))


# Every op eager but attention, so veomni's side of the generate comparison runs the oracles upstream runs.
EAGER_OPS = dict(
    attention="sdpa", rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager",
    cross_entropy="eager", load_balancing_loss="eager", gated_delta_rule="eager", causal_conv1d="eager",
    rms_norm_gated="eager",
)  # fmt: skip
UPSTREAM = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
            "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}  # fmt: skip


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_resume_and_export_under_sp_and_ep(dist_pools, references, tmp_path, gdn_decoding_on_torch, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from veomni.kernels import OpsConfig
    from veomni.models.build import build_model

    weights, _ = references(name)
    raw = hybrid_recipe(str(tmp_path / "ckpt"), name, weights, sp=2, ep=2 if name in MOES else 1)
    pool = dist_pools.get(2, "gloo")
    pool.run(_save, raw)
    assert pool.run(_resume_and_export, raw) == [1, 1]
    export = tmp_path / "ckpt" / "hf"
    exported = load_file(export / "model.safetensors")
    source = load_file(f"{weights}/model.safetensors")
    assert set(exported) == set(source)  # the upstream key layout again, nothing missing or extra
    # The resumed run holds exactly what the saving run trained: every SP/FSDP shard and every EP rank's experts
    # back in their places (a checkpoint read into the wrong shard would still differ from the source below).
    trained = load_file(tmp_path / "ckpt" / "trained" / "model.safetensors")
    assert [k for k in trained if not torch.equal(exported[k], trained[k])] == []
    # One AdamW step moves every parameter it steps: an unchanged one was left out of training or of the export
    # (the DeltaNet decay and conv, the gated attention, every expert, the router and shared expert alike).
    assert [k for k in source if torch.equal(exported[k], source[k])] == []
    plain = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(plain).__name__ == UPSTREAM[name]
    # Trained (not freshly initialised) weights through both implementations: plain transformers' cached greedy
    # decoding and veomni's model built from the same export pick the same tokens, and give the same logits over
    # the whole sequence (greedy tokens alone would hide a small mismatch).
    ours = build_model(str(export), weights=str(export), ops=OpsConfig(**EAGER_OPS)).eval()
    prompt = torch.tensor([[3, 141, 59, 26, 535, 89, 79, 32]])
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        generated = plain.generate(prompt, **settings)
        assert torch.equal(ours.generate(prompt, **settings), generated)
        torch.testing.assert_close(ours(generated).logits, plain(generated).logits, rtol=1e-5, atol=1e-5)


def test_resumes_exactly_from_a_checkpoint_saved_before_the_first_step(dist_pools, tmp_path):
    # No parameter, the Gated DeltaNet layers' included, has AdamW state at step 0 (issue 42).
    from resume_helpers import check_exact_resume, resume_before_gradients

    weights = initial_weights(HYBRIDS["qwen3_next"], str(tmp_path / "weights"))
    raw = hybrid_recipe(str(tmp_path / "run"), "qwen3_next", weights)
    (result,) = dist_pools.get(1, "gloo").run(resume_before_gradients, raw, 0, STEPS)
    check_exact_resume(result, some="linear_attn")
