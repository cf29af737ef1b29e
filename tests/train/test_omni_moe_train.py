"""Qwen3-Omni-MoE thinker through the trainer (task omni): audio parts expand to Qwen3's token rule (13 tokens per
100-frame chunk) with the thinker's own mrope positions; a row's audio changes the loss; one gloo rank trains and
exports a thinker that plain transformers loads; EP2 and SP2 x EP2 on 2 ranks give the one-rank per-step loss and
grad norm (fp32), with micro-batches that hold no audio on some ranks.

Assets are test_omni_train's (tokenizer with audio and vision tokens, a 16-bin Whisper feature extractor, tones
and a png) with a tiny Qwen3-Omni-MoE thinker at the trainer's vocabulary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_multimodal_data import IMAGE, REF, START, VIDEO, model_data, png
from test_omni_train import A_START, AUDIO, MELS, make_omni_dir, omni_recipe, row, tone

from veomni.train.data.encode import Sample
from veomni.train.data.multimodal_batch import collate_multimodal

STEPS = 2
LAYOUTS = [(1, 2), (2, 2)]  # (sp, ep) on 2 ranks; dp_shard fills the rest


def thinker_config():
    from transformers import Qwen3OmniMoeThinkerConfig

    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": 1032, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
            "router_aux_loss_coef": 0.05,
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        audio_config={
            "num_mel_bins": MELS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 48,
            "d_model": 32, "max_source_positions": 32, "n_window": 50, "n_window_infer": 200, "output_dim": 64,
            "downsample_hidden_size": 8,
        },
        audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, audio_start_token_id=A_START,
        vision_start_token_id=START, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    root = tmp_path_factory.mktemp("omni_moe")
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png(16, 16))
    rows = []
    for i in range(8):
        # 0.6 to 1.3 s at 16 kHz: 60 to 130 mel frames, some past one 100-frame chunk.
        name = tone(media / f"t{i}.wav", 220 * (1 + i % 4), 0.6 + 0.1 * i)
        parts = [{"type": "audio", "audio": name}]
        if i % 3 == 0:
            parts.append({"type": "image", "image": "a.png"})
        rows.append(row(*parts, answer=f"A tone of {220 * (1 + i % 4)} hertz."))
        if i % 2:
            # A text-only row of ~490 of the 512 micro-batch tokens (no audio row fits beside it): under data
            # parallelism one rank's micro-batch has audio while the other's has none.
            rows.append(row(answer=" ".join(["red green blue yellow"] * 118)))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    weights = root / "weights"
    Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config()).save_pretrained(weights)
    processor = make_omni_dir(root / "processor")
    # A 2 s audio window (test_omni_train's is 1 s): clips past one 100-frame chunk fit.
    config = json.loads((Path(processor) / "preprocessor_config.json").read_text())
    config.update({"chunk_length": 2, "n_samples": 32000, "nb_max_frames": 200})
    (Path(processor) / "preprocessor_config.json").write_text(json.dumps(config))
    return {
        "processor": processor, "media": str(media), "train": str(root / "train.jsonl"),
        "weights": str(weights),
    }  # fmt: skip


def encoder(assets: dict):
    from veomni.train.data.build import encoder_for
    from veomni.train.data.encode import load_tokenizer
    from veomni.train.recipe import recipe_from_dict

    data = recipe_from_dict(omni_recipe(assets, "/tmp/unused")).data
    return encoder_for(data, load_tokenizer(assets["processor"]), **model_data(thinker_config()))


def test_audio_expands_to_qwen3s_token_rule_and_changes_the_loss(assets):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    from veomni.models.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )
    from veomni.models.qwen3_omni_moe.positions import Qwen3OmniMoePositions
    from veomni.train.tasks.vision import OmniTask

    enc = encoder(assets)
    long = row({"type": "audio", "audio": "t7.wav"}, {"type": "image", "image": "a.png"})
    ids, trained, sample = enc(long, REF)
    frames = sample.audio_features[0].shape[1]
    assert frames > 100  # past one chunk
    assert int((ids == AUDIO).sum()) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    want = Qwen3OmniMoePositions(thinker_config())(ids, sample.image_grid_thw, None, np.array([frames]))
    np.testing.assert_array_equal(sample.mrope, want)

    torch.manual_seed(0)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config()).eval()
    with (
        torch.no_grad()
    ):  # at the 0.02 init the clips' content barely reaches the LM (see test_qwen3_omni_moe)
        tower = model.model.audio_tower
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
            conv.weight.normal_(0.0, 0.2)
    task = OmniTask.for_model(model)

    def loss(*rows: dict) -> float:
        batch = collate_multimodal(
            [Sample(*enc(r, REF)[:2], i, media=enc(r, REF)[2]) for i, r in enumerate(rows)]
        )
        n = (batch["labels"] != -100).sum().float()
        with torch.no_grad():
            return float(task.forward(model, batch, torch.device("cpu"), n).loss)

    low = loss(row({"type": "audio", "audio": "t0.wav"}), row())
    high = loss(row({"type": "audio", "audio": "t4.wav"}), row())  # same pitch, longer clip
    assert math.isfinite(low) and math.isfinite(high) and abs(low - high) > 1e-4


def moe_recipe(assets: dict, out: str, *, sp: int = 1, ep: int = 1) -> dict:
    raw = omni_recipe(assets, out, steps=STEPS)
    raw["parallel"] = {"sp": sp, "ep": ep}
    raw["ops"] = {"moe_experts": "torch"}
    return raw


def _steps(ctx, raw: dict, export: str | None) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(STEPS)]
    audioless = sum(b.get("input_features") is None for s in steps for b in s.micro_batches)
    stats = [train_step(run, s) for s in steps]
    if export is not None:
        run.task.export(run.model, Path(export), run.tokenizer, run.state)
    coefs = (run.task.aux_loss_coef, run.model.router_aux_loss_coef)
    return {"stats": stats, "audioless": audioless, "coefs": coefs}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("one")
    export = tmp / "export"
    result = dist_pools.get(1, "gloo").run(_steps, moe_recipe(assets, str(tmp / "run")), str(export))[0]
    return {**result, "export": export}


def test_one_rank_trains_and_exports_a_thinker_transformers_loads(one_rank, assets):
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    # The loop adds the aux term itself: the task holds text_config's coefficient, the model's copy is zeroed.
    assert one_rank["coefs"] == (0.05, 0.0)
    assert all(math.isfinite(s["loss"]) for s in one_rank["stats"])
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(one_rank["export"])
    start = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(assets["weights"]).state_dict()
    trained = model.state_dict()
    assert trained.keys() == start.keys()
    for key in ("model.audio_tower.conv2d1.weight", "model.language_model.layers.1.mlp.experts.gate_up_proj"):
        assert not torch.equal(trained[key], start[key]), key


def test_ep2_and_sp2_x_ep2_match_one_rank(dist_pools, assets, one_rank, tmp_path):
    pool = dist_pools.get(2, "gloo")
    for sp, ep in LAYOUTS:
        layout = f"sp={sp} ep={ep}"
        raw = moe_recipe(assets, str(tmp_path / layout.replace(" ", "_")), sp=sp, ep=ep)
        results = pool.run(_steps, raw, None)
        assert sum(r["audioless"] for r in results) > 0, layout  # some micro-batch runs the audio dummy
        for result in results:
            for step, (got, want) in enumerate(zip(result["stats"], one_rank["stats"], strict=True)):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (layout, step)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (layout, step)


def test_resumes_exactly_from_a_checkpoint_saved_before_the_first_step(dist_pools, assets, tmp_path):
    # No parameter, the audio tower and the experts included, has AdamW state at step 0 (issue 42).
    from resume_helpers import check_exact_resume, resume_before_gradients

    (result,) = dist_pools.get(1, "gloo").run(
        resume_before_gradients, moe_recipe(assets, str(tmp_path)), 0, 2
    )
    check_exact_resume(result, some="audio_tower")
