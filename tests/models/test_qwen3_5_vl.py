"""The Qwen3.5 and Qwen3.5-MoE vision-language adapters (``qwen3_5`` / ``qwen3_5_moe``) against upstream transformers'
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``, single process; checkpoints in the Hub
layout (per-expert keys for the MoE) through the scoped recipes and back; export -> plain transformers generates.

Oracle: upstream's model with the same weights, fp32. Without kernels the adapters are bitwise upstream on image
batches (aux loss included); with veomni's kernels (encoder varlen tower, Gated DeltaNet kernels, eager maths) within
fp32 tolerance, also with videos (one tower pass over images and clips, upstream's one per modality). Ulysses SP:
test_qwen3_5_vl_sp.py. Composite Qwen3.5-MoE loading under FSDP: test_composite_load.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from loading_fixtures import checkpoint_tensors
from test_qwen3_vl import END, IMAGE, IMAGES, MIXED, START, TEXT_ONLY, VIDEO, VOCAB, vlm_batch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as upstream_moe

from veomni.core.ep import apply_expert_plan
from veomni.kernels import KERNELS, OpsConfig, detect_hardware
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.qwen3_5.generated import patched_modeling_qwen3_5 as ours
from veomni.models.qwen3_5_moe.generated import patched_modeling_qwen3_5_moe as ours_moe
from veomni.models.registry import MODELS

TASK = "image_text_to_text"
EAGER_OPS = dict(
    rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager", cross_entropy="eager",
    load_balancing_loss="eager", gated_delta_rule="eager", causal_conv1d="eager", rms_norm_gated="eager",
)  # fmt: skip
FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def torch_fallback(monkeypatch):
    # As in test_qwen3_next: upstream sends its Gated DeltaNet to fla (CUDA-only) whenever fla is installed, and the
    # upstream models here run on CPU tensors.
    for module in (upstream, upstream_moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):  # fmt: skip
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, getattr(fn, "__wrapped__", fn))


def tiny_config(moe: bool = False, **text) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """A linear-attention layer then a full-attention one (partial RoPE over interleaved mrope sections that touch
    t, h and w), a 2-block tower without deepstack; MoE: 4 experts, top-2, shared expert, aux loss on."""
    text_config = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip
    if moe:
        text_config.update(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)  # fmt: skip
    text_config.update(text)
    vision_config = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=2, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
    )  # fmt: skip
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return config_class(
        text_config=text_config, vision_config=vision_config, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False,
    )  # fmt: skip


def upstream_class(moe: bool) -> type:
    return upstream_moe.Qwen3_5MoeForConditionalGeneration if moe else upstream.Qwen3_5ForConditionalGeneration


def our_class(moe: bool) -> type:
    return ours_moe.Qwen3_5MoeForConditionalGeneration if moe else ours.Qwen3_5ForConditionalGeneration


def build_pair(moe: bool, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config(moe)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    ref = upstream_class(moe)(copy.deepcopy(config))
    with torch.no_grad():  # upstream zero-initialises the (1 + w) text norms; random ones exercise the offset
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") and ".visual." not in name:
                p.normal_(0, 0.1)
    model = our_class(moe)(config)
    model.load_state_dict(ref.state_dict(), strict=True)
    return ref, model


def run(model: torch.nn.Module, batch: dict) -> tuple:
    """(logits, loss, aux loss or None, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)  # as the trainer calls it; a cache sends the Gated DeltaNet upstream
    out.loss.backward()
    logits = None if out.logits is None else out.logits.detach()
    aux = getattr(out, "aux_loss", None)
    return logits, out.loss.detach(), None if aux is None else aux.detach(), {
        n: p.grad for n, p in model.named_parameters()
    }


MOE = pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])


@MOE
def test_sub_models_registry_and_moe_attributes(moe):
    _, model = build_pair(moe)
    module = ours_moe if moe else ours
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    assert type(model.model.visual) is getattr(module, f"{prefix}VisionModel")
    assert type(model.model.language_model) is getattr(module, f"{prefix}TextModel")
    resolved = MODELS.model_class(model.config, TASK)
    assert resolved.cls is our_class(moe) and resolved.registered
    assert resolved.fast_paths == ({"sp", "ep", "fused_kernels"} if moe else {"sp", "fused_kernels"})
    assert MODELS.model_class(model.config, "base").cls is getattr(module, f"{prefix}Model")
    if moe:
        assert (model.num_experts, model.num_experts_per_tok, model.router_aux_loss_coef) == (4, 2, 0.05)


@MOE
@pytest.mark.parametrize("rows", [IMAGES, TEXT_ONLY], ids=["images", "text-only"])
def test_no_kernels_is_bitwise_upstream(moe, rows):
    ref, model = build_pair(moe)
    batch = vlm_batch(rows)
    want, got = run(ref, batch), run(model, batch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if moe:
        assert float(got[2]) > 0 and torch.equal(got[2], want[2])
    unequal = [n for n, g in got[3].items() if (g is None) != (want[3][n] is None) or (
        g is not None and not torch.equal(g, want[3][n]))]  # fmt: skip
    assert not unequal, unequal


@MOE
def test_kernels_and_encoder_attention_match_upstream_on_images_and_videos(moe, monkeypatch):
    ref, model = build_pair(moe)
    apply_ops(model, OpsConfig(attention="sdpa", **EAGER_OPS))
    assert model.model.visual.config._attn_implementation == "veomni_sdpa"
    batch = vlm_batch(MIXED, seed=2)
    want = run(ref, batch)

    def upstream_path(*args, **kwargs):
        raise AssertionError("the adapter's Gated DeltaNet ran upstream's forward, not the kernels")

    layer = type(ref.model.language_model.layers[0].linear_attn)
    monkeypatch.setattr(layer, "forward", upstream_path)  # the class our override delegates to with a cache
    got = run(model, batch)
    torch.testing.assert_close(got[0], want[0], **FP32)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    if moe:
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for name, grad in got[3].items():
        assert grad is not None, name  # the tower, both layer kinds and (MoE) every expert trained
        torch.testing.assert_close(grad, want[3][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_dummy_forward_is_zero_and_reaches_every_tower_parameter():
    _, model = build_pair(moe=False)
    out = model.model.visual.dummy_forward()
    assert out.shape == () and float(out.detach()) == 0.0
    out.backward()
    missing = [n for n, p in model.model.visual.named_parameters() if p.grad is None]
    assert not missing, missing


def test_pixels_without_grid_are_refused():
    _, model = build_pair(moe=False)
    batch = vlm_batch(IMAGES)
    del batch["image_grid_thw"]
    with pytest.raises(ValueError, match="image pixel rows were given without their grid_thw"):
        model(**batch)


def test_moe_parallel_plan_shards_only_the_language_models_experts():
    with torch.device("meta"):
        model = ours_moe.Qwen3_5MoeForConditionalGeneration(tiny_config(moe=True))
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=2, ep_rank=1)
    assert sorted(shards) == sorted(
        f"model.language_model.layers.{i}.mlp.experts.{n}" for i in range(2) for n in ("down_proj", "gate_up_proj")
    )
    assert all((s.start, s.stop) == (2, 4) for s in shards.values())
    with torch.device("meta"):
        base = ours_moe.Qwen3_5MoeModel(tiny_config(moe=True))
    assert len(apply_expert_plan(base, base.get_parallel_plan(), ep_size=4, ep_rank=0)) == 4


# ---------------------------------------------------------------- checkpoints and export


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def checkpoint(request, tmp_path_factory) -> tuple[bool, str]:
    """Written by upstream's ``save_pretrained`` (the Hub layout: the MoE's experts per expert)."""
    moe = request.param
    path = tmp_path_factory.mktemp("qwen3_5_moe" if moe else "qwen3_5")
    torch.manual_seed(3)
    upstream_class(moe)(tiny_config(moe)).save_pretrained(path)
    return moe, str(path)


def test_checkpoint_loads_like_transformers_and_exports_back(checkpoint, tmp_path):
    moe, path = checkpoint
    saved = checkpoint_tensors(path)
    if moe:  # the Hub's per-expert layout, merged on load by the text sub-model's scoped recipe
        assert "model.language_model.layers.1.mlp.experts.3.gate_proj.weight" in saved
    model = build_model(path, weights=path, ops=OpsConfig(attention="eager", **EAGER_OPS), task=TASK)
    assert type(model) is our_class(moe)
    ref = upstream_class(moe).from_pretrained(path)
    want, got = ref.state_dict(), model.state_dict()
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]

    export_hf(model, tmp_path / "out")
    exported = checkpoint_tensors(str(tmp_path / "out"))
    assert sorted(exported) == sorted(saved)
    assert not [k for k in saved if not torch.equal(exported[k], saved[k])]
    back = upstream_class(moe).from_pretrained(tmp_path / "out").state_dict()
    assert not [k for k in want if not torch.equal(back[k], want[k])]


def test_export_generates_in_plain_transformers_like_ours(checkpoint, tmp_path):
    moe, path = checkpoint
    model = build_model(path, weights=path, ops=OpsConfig(attention="sdpa", **EAGER_OPS), task=TASK)
    export_hf(model, tmp_path / "out")
    plain = upstream_class(moe).from_pretrained(tmp_path / "out").eval()
    batch = vlm_batch([[("image", (1, 4, 4))]], seed=8)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = plain.generate(**inputs, **settings)
    assert want.shape[1] == inputs["input_ids"].shape[1] + 4
    assert torch.equal(model.eval().generate(**inputs, **settings), want)


@pytest.mark.cuda
@MOE
def test_gpu_defaults_match_upstream(moe):
    """On a GPU: the CUDA default kernels (fla's Gated DeltaNet and causal conv, Triton norms / RoPE / SwiGLU / fused
    cross-entropy / grouped-GEMM experts, veomni's varlen-capable attention on the tower) against upstream's model on
    the eager oracles, fp32 weights; TF32-level agreement (fla's matmuls)."""
    ref, model = build_pair(moe)
    ref, model = ref.cuda(), model.cuda()
    apply_ops(model, OpsConfig(attention="sdpa", compile="off"))
    # fla, unless fla computes wrong gradients on this GPU / Triton (then the default is the oracle, with a warning).
    broken = KERNELS.backend_problem("gated_delta_rule", "fla", detect_hardware())  # incl. fla not installed
    assert model.veomni_kernels.config.gated_delta_rule == ("eager" if broken else "fla")
    batch = {k: v.cuda() for k, v in vlm_batch(MIXED, seed=2).items()}
    want, got = run(ref, batch), run(model, batch)
    if got[0] is not None:  # a fused cross-entropy default never materialises [T, V] logits
        torch.testing.assert_close(got[0], want[0], rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(got[1], want[1], rtol=3e-3, atol=3e-3)
    if moe:
        torch.testing.assert_close(got[2], want[2], rtol=3e-3, atol=3e-3)
    for name, grad in got[3].items():
        torch.testing.assert_close(grad, want[3][name], rtol=3e-2, atol=3e-3, msg=lambda m, n=name: f"{n}: {m}")
