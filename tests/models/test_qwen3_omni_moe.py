"""The generated Qwen3-Omni-MoE thinker adapter against upstream transformers, single process.

Oracle: transformers' own ``Qwen3OmniMoeThinkerForConditionalGeneration`` with the same weights (fp32). With no
kernels and HF attention names the adapter computes exactly what upstream computes (logits, loss with the router
aux term, every gradient); with veomni's attention in both towers and the grouped-GEMM experts interface it is
within fp32 tolerance.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as upstream

from veomni.core.ep import apply_expert_plan
from veomni.kernels import OpsConfig
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.qwen3_omni_moe.generated import patched_modeling_qwen3_omni_moe as ours
from veomni.models.qwen3_omni_moe.towers import audio_token_count
from veomni.models.registry import MODELS

AUDIO, IMAGE, VIDEO, V_START, V_END, A_START, A_END = 100, 101, 102, 103, 104, 105, 106
VOCAB, MELS = 128, 16
TASK = "any_to_any"
EAGER_OPS = dict(rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager", moe_experts="eager",
                 load_balancing_loss="eager")  # fmt: skip


def tiny_config(**text) -> Qwen3OmniMoeThinkerConfig:
    """2 text layers (layer 0 dense, layer 1 routed: 4 experts, top-2, aux loss on) with interleaved mrope, a
    2-block ViT with deepstack after both blocks, a 2-layer audio tower (100-frame chunks, 26-token windows)."""
    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
            "decoder_sparse_step": 1, "router_aux_loss_coef": 0.05, "output_router_logits": True, **text,
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
        },
        audio_config={
            "num_mel_bins": MELS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 48,
            "d_model": 32, "max_source_positions": 32, "n_window": 50, "n_window_infer": 200, "output_dim": 64,
            "downsample_hidden_size": 8,
        },
        audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, audio_start_token_id=A_START,
        vision_start_token_id=V_START, tie_word_embeddings=False,
    )  # fmt: skip


def omni_batch(rows: list[list[tuple[str, int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of text with audio (``("audio", frames)``) and image (``("image", side)``, side x side patches) runs.

    Rows are right-padded with text to one length; labels are the ids with placeholders ignored (-100).
    """
    gen = torch.Generator().manual_seed(seed)
    ids_rows, clips, pixels, grids = [], [], [], []
    for items in rows:
        ids: list[int] = torch.randint(0, 90, (2,), generator=gen).tolist()
        for kind, size in items:
            if kind == "audio":
                ids += [A_START] + [AUDIO] * int(audio_token_count(size)) + [A_END]
                clips.append(torch.randn(MELS, size, generator=gen))
            else:
                ids += [V_START] + [IMAGE] * (size * size // 4) + [V_END]
                pixels.append(torch.randn(size * size, 3 * 2 * 2 * 2, generator=gen))
                grids.append((1, size, size))
            ids += torch.randint(0, 90, (2,), generator=gen).tolist()
        ids_rows.append(ids)
    width = max(len(r) for r in ids_rows)
    input_ids = torch.tensor(
        [r + torch.randint(0, 90, (width - len(r),), generator=gen).tolist() for r in ids_rows]
    )
    labels = input_ids.masked_fill(input_ids >= AUDIO, -100)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if clips:
        frames = max(c.shape[1] for c in clips)
        batch["input_features"] = torch.stack(
            [torch.nn.functional.pad(c, (0, frames - c.shape[1])) for c in clips]
        )
        batch["feature_attention_mask"] = torch.stack(
            [torch.arange(frames) < c.shape[1] for c in clips]
        ).long()
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
        batch["image_grid_thw"] = torch.tensor(grids)
    return batch


# 250 frames: two full chunks and a 50-frame tail, 33 tokens in two attention windows (26 + 7).
MIXED = [[("audio", 250), ("image", 4)], [("audio", 45)], [("image", 8)]]


def pair(seed: int = 0, attn: str = "sdpa"):
    config = tiny_config()
    config._attn_implementation = attn
    torch.manual_seed(seed)
    ref = upstream.Qwen3OmniMoeThinkerForConditionalGeneration(copy.deepcopy(config)).eval()
    with torch.no_grad():
        # At the 0.02 init the convolutions' output is swamped by the sinusoidal positions: the clips' content
        # would barely reach the language model, and the tests would not see it.
        tower = ref.model.audio_tower
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
            conv.weight.normal_(0.0, 0.2)
    model = ours.Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    return ref, model


def run(model: torch.nn.Module, batch: dict) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    logits = None if out.logits is None else out.logits.detach()
    return logits, out.loss.detach(), out.aux_loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_registry_and_generated_file_hold_the_thinker_only():
    resolved = MODELS.model_class(tiny_config(), TASK)
    assert resolved.cls is ours.Qwen3OmniMoeThinkerForConditionalGeneration and resolved.registered
    assert resolved.fast_paths == {"sp", "ep", "fused_kernels"}
    names = set(vars(ours))
    assert not {n for n in names if "Talker" in n or "Code2Wav" in n}
    assert "Qwen3OmniMoeForConditionalGeneration" not in names
    assert all(hasattr(ours, n) for n in ours.__all__)
    _, model = pair()
    assert (model.num_experts, model.num_experts_per_tok, model.router_aux_loss_coef) == (4, 2, 0.05)
    assert isinstance(model.model.language_model.layers[1].mlp, ours.Qwen3OmniMoeThinkerTextSparseMoeBlock)


def test_fresh_init_draws_upstreams_weights():
    """The experts and routers are initialised (transformers would skip their parameter-less sparse block in a
    model defined outside its package, leaving torch.empty memory) with upstream's draws."""
    states = []
    for cls in (
        upstream.Qwen3OmniMoeThinkerForConditionalGeneration,
        ours.Qwen3OmniMoeThinkerForConditionalGeneration,
    ):
        torch.manual_seed(7)
        states.append(cls(tiny_config()).state_dict())
    assert sorted(states[0]) == sorted(states[1])
    assert not [k for k, v in states[0].items() if not torch.equal(v, states[1][k])]


def test_eager_parity_with_upstream_on_a_mixed_batch():
    ref, model = pair()
    batch = omni_batch(MIXED)
    want, got = run(ref, batch), run(model, batch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert float(got[2]) > 0
    unequal = [n for n, g in got[3].items() if (g is None) != (want[3][n] is None) or (
        g is not None and not torch.equal(g, want[3][n]))]  # fmt: skip
    assert not unequal, unequal
    # Every tower and the deepstack mergers took part.
    for name in (
        "model.audio_tower.conv2d1.weight",
        "model.visual.patch_embed.proj.weight",
        "model.visual.merger_list.0.mlp.0.weight",
        "model.language_model.layers.1.mlp.experts.down_proj",
    ):
        assert got[3][name].abs().sum() > 0, name  # fmt: skip


def test_veomni_attention_and_experts_match_upstream():
    """veomni_sdpa in the towers (one encoder varlen call over all audio windows / images) and the language
    model, the experts on veomni's grouped-GEMM interface (torch backend on CPU): fp32 tolerance of upstream."""
    ref, model = pair()
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": "torch"}))
    assert model.config.text_config._experts_implementation == "veomni"
    assert model.model.audio_tower.config._attn_implementation == "veomni_sdpa"
    assert model.model.visual.config._attn_implementation == "veomni_sdpa"
    batch = omni_batch(MIXED, seed=2)
    want, got = run(ref, batch), run(model, batch)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for name, grad in got[3].items():
        torch.testing.assert_close(
            grad, want[3][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_audio_changes_the_loss_and_bad_audio_input_raises():
    _, model = pair()
    batch = omni_batch([[("audio", 130)], [("audio", 45)]])
    base = model(**batch).loss
    assert not torch.allclose(model(**dict(batch, input_features=batch["input_features"] * 3.0)).loss, base)
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == AUDIO).nonzero()[0]] = 5
    with pytest.raises(
        ValueError, match=r"audio placeholder tokens and audio features differ: 22 tokens .* 23 feature rows"
    ):
        model(**dict(batch, input_ids=ids))
    with pytest.raises(ValueError, match="without feature_attention_mask"):
        model(input_ids=batch["input_ids"], input_features=batch["input_features"])
    odd = tiny_config()
    odd.audio_config.n_window = 8
    with pytest.raises(ValueError, match="n_window must be 50 .* found 8"):
        ours.Qwen3OmniMoeAudioEncoder(odd.audio_config).dummy_forward()


def test_audio_token_rule_is_upstreams():
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    frames = torch.arange(1, 420)
    assert torch.equal(audio_token_count(frames), _get_feat_extract_output_lengths(frames))
    assert audio_token_count(250) == 33


def test_dummy_forwards_reach_every_tower_parameter():
    _, model = pair()
    for tower in (model.model.audio_tower, model.model.visual):
        out = tower.dummy_forward()
        assert out.shape == () and float(out.detach()) == 0.0
        out.backward()
        assert [n for n, p in tower.named_parameters() if p.grad is None] == []
    model.to(torch.bfloat16)
    assert model.model.audio_tower.dummy_forward().dtype == torch.bfloat16


def test_talker_and_speech_generation_raise():
    _, model = pair()
    with pytest.raises(NotImplementedError, match="Qwen3-Omni-MoE thinker only"):
        model.enable_talker()
    batch = omni_batch([[("audio", 45)]])
    with pytest.raises(NotImplementedError, match=r"speech arguments \['speaker'\]"):
        model.generate(input_ids=batch["input_ids"], speaker="Ethan")


def test_host_positions_are_the_models_own_and_pickle():
    from veomni.models.qwen3_omni_moe.positions import Qwen3OmniMoePositions

    _, model = pair()
    batch = omni_batch([[("audio", 250), ("image", 4), ("audio", 45), ("image", 8)]])
    positions = pickle.loads(pickle.dumps(Qwen3OmniMoePositions(tiny_config())))
    got = positions(
        batch["input_ids"][0].numpy(),
        image_grid_thw=batch["image_grid_thw"].numpy(),
        audio_frames=batch["feature_attention_mask"].sum(-1).numpy(),
    )
    want, _ = model.model.get_rope_index(
        batch["input_ids"], batch["image_grid_thw"], None, batch["attention_mask"], False,
        batch["feature_attention_mask"].sum(-1), None,
    )  # fmt: skip
    assert got.dtype == np.int64 and got.shape == (3, batch["input_ids"].shape[1])
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert not (got[1] == got[0]).all()
    assert positions.audio_tokens(250) == 33
    # The packed path (no attention_mask, explicit positions) gives the same loss as the model's own positions;
    # without a mask upstream would fall back to 1-D positions, the adapter still builds mrope ones.
    explicit = model(**{**batch, "attention_mask": None}, position_ids=torch.as_tensor(got)[:, None]).loss
    assert torch.equal(explicit, model(**batch).loss)
    assert torch.equal(model(**{**batch, "attention_mask": None}).loss, explicit)
    with pytest.raises(TypeError, match="needs a Qwen3OmniMoeThinkerConfig"):
        Qwen3OmniMoePositions(tiny_config().text_config)
    # A video whose time step is 0.03 s x 25 positions/s = 0.75: upstream's float positions do not fit int64.
    video = np.array([1, V_START, VIDEO, VIDEO, V_END, 2])
    assert positions(
        video, video_grid_thw=np.array([[2, 2, 2]]), second_per_grids=np.array([0.04])
    ).shape == (3, 6)
    with pytest.raises(ValueError, match="not whole numbers"):
        positions(video, video_grid_thw=np.array([[2, 2, 2]]), second_per_grids=np.array([0.03]))
    with pytest.raises(ValueError, match="audio placeholders but no audio_frames"):
        positions(batch["input_ids"][0].numpy(), image_grid_thw=batch["image_grid_thw"].numpy())


def test_parallel_plan_shards_only_the_language_models_experts():
    with torch.device("meta"):
        model = ours.Qwen3OmniMoeThinkerForConditionalGeneration(tiny_config(num_experts=8))
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=4, ep_rank=3)
    assert sorted(shards) == [
        f"model.language_model.layers.1.mlp.experts.{n}" for n in ("down_proj", "gate_up_proj")
    ]
    assert all((s.start, s.stop) == (6, 8) for s in shards.values())
    assert model.model.language_model.layers[1].mlp.experts.gate_up_proj.shape == (2, 48, 64)
    with torch.device("meta"):
        model = ours.Qwen3OmniMoeThinkerForConditionalGeneration(tiny_config(num_experts=8))
    with pytest.raises(ValueError, match=r"its 8 experts \(dim 0\) cannot be split evenly across ep_size=3"):
        apply_expert_plan(model, model.get_parallel_plan(), ep_size=3, ep_rank=0)


def test_omni_task_counts_routed_experts_at_top_k_over_e_and_excludes_the_towers():
    from veomni.train.loop import meta_instance
    from veomni.train.tasks import build_task

    probe = meta_instance(tiny_config(), TASK)
    task = build_task("omni", probe)
    assert task.aux_loss_coef == 0.05 and task.model_config is probe.config
    assert task.data_rules is not None and task.data_rules.encoder == "audio_visual"  # from the family
    dense, experts = 0.0, 0.0
    for name, param in probe.named_parameters():
        if (
            param.dim() < 2
            or name.startswith(("model.visual.", "model.audio_tower."))
            or "embed_tokens" in name
        ):
            continue
        if ".mlp.experts." in name:
            experts += param.numel()
        else:
            dense += param.numel()
    assert experts > 0 and task.flops_per_token == pytest.approx(6.0 * (dense + experts * 2 / 4))


@pytest.mark.cuda
def test_gpu_kernels_match_upstream():
    """On a GPU: the Triton kernels (grouped-GEMM experts, RMSNorm, RoPE, SwiGLU, fused cross-entropy, load
    balancing) and the encoder varlen towers against upstream eager, fp32 with TF32 off; bf16 dummy forwards take
    the weights' dtype."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref, model = pair()
    ref, model = ref.cuda(), model.cuda()
    ops = dict(attention="sdpa", moe_experts="triton", rms_norm="triton", rope="triton", swiglu="triton",
               cross_entropy="triton", load_balancing_loss="triton")  # fmt: skip
    apply_ops(model, OpsConfig(**ops))
    batch = {k: v.cuda() for k, v in omni_batch(MIXED, seed=4).items()}
    want, got = run(ref, batch), run(model, batch)
    assert got[0] is None  # the fused loss never materialises logits
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for name, grad in got[3].items():
        torch.testing.assert_close(
            grad, want[3][name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    model.to(torch.bfloat16)
    for tower in (model.model.audio_tower, model.model.visual):
        assert tower.dummy_forward().dtype == torch.bfloat16


def test_omni_task_per_token_flops_ignore_whether_the_towers_are_frozen():
    # The towers are not counted per text token at all, so freezing them (which halves or thirds their own count)
    # leaves the language model's term unchanged; it was once lowered by 4 FLOPs per audio-tower weight.
    from veomni.core.freeze import freeze_modules
    from veomni.train.loop import meta_instance
    from veomni.train.tasks import build_task

    trained = build_task("omni", meta_instance(tiny_config(), TASK))
    probe = meta_instance(tiny_config(), TASK)
    freeze_modules(probe, ["model.audio_tower", "model.visual"], where="test")
    assert build_task("omni", probe).flops_per_token == trained.flops_per_token
