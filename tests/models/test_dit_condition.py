"""WanConditionModel against diffusers' Wan pipelines on tiny models saved in the Wan diffusers layout: prompt
embeddings == WanPipeline.encode_prompt, I2V first-frame condition == WanImageToVideoPipeline.prepare_latents,
CLIP image embeddings == its encode_image, frozen models, seeded determinism, the flow-matching relation of
process_condition, prompt dropout, and missing-component errors.

The tokenizer is built offline: a ~40-piece Unigram model (tokenizers library) with T5's conventions (Metaspace
pre-tokenizer, ``</s>`` appended, ``<pad>`` id 0) wrapped in transformers' T5 tokenizer, saved with
save_pretrained, so AutoTokenizer loads it as the pipelines would load Wan's UMT5 tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")  # the veomni-models[diffusers] extra; the GPU image may lack it
from diffusers import (  # noqa: E402
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
)
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

from veomni.models.diffusers.flow_matching import FlowMatchingSchedule, add_noise, dp_generator
from veomni.models.wan.condition import WanConditionConfig, WanConditionModel, normalize_latents
from veomni.models.wan.pipeline_dir import ConditionCheckpointError

WORDS = ["a", "cat", "dog", "runs", "on", "the", "grass", "red", "ball", "jumps", "over", "blue", "sky"]
MAX_LEN = 12
PROMPTS = ["a cat runs on the grass", "  a red &amp; blue   ball ", "a dog jumps over the blue sky " * 3]


def tiny_tokenizer() -> T5TokenizerFast:
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(f"\u2581{w}", -1.0 - i) for i, w in enumerate(WORDS)]
    vocab += [(c, -20.0) for c in "abcdefghijklmnopqrstuvwxyz&;"] + [("\u2581", -30.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0
    )


def write_wan_dir(root: Path, *, i2v: bool) -> Path:
    """A Wan diffusers pipeline directory of tiny, randomly initialised components, written by the pipeline's
    own ``save_pretrained`` (model_index.json and the subfolders, no transformer)."""
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    umt5 = UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
    )  # fmt: skip
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[1.5, 0.5, 2.0, 1.25],
    )  # fmt: skip
    components = dict(
        tokenizer=tokenizer,
        text_encoder=UMT5EncoderModel(umt5),
        vae=vae,
        # Wan's diffusers repos ship UniPC with flow sigmas (inference); the training shift is read from it.
        scheduler=UniPCMultistepScheduler(
            use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction"
        ),
    )
    if i2v:
        clip = CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8, projection_dim=16,
        )  # fmt: skip
        components["image_encoder"] = CLIPVisionModel(clip)
        components["image_processor"] = CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        WanImageToVideoPipeline(**components).save_pretrained(root)
    else:
        WanPipeline(**components).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory) -> Path:
    return write_wan_dir(tmp_path_factory.mktemp("wan_t2v"), i2v=False)


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    return write_wan_dir(tmp_path_factory.mktemp("wan_i2v"), i2v=True)


def videos() -> list[torch.Tensor]:
    """Two clips of different shapes, RGB in [-1, 1]: [3, 5, 16, 16] and [3, 1, 16, 32]."""
    g = torch.Generator().manual_seed(1)
    return [torch.rand(3, 5, 16, 16, generator=g) * 2 - 1, torch.rand(3, 1, 16, 32, generator=g) * 2 - 1]


def t2v_pipeline(model: WanConditionModel) -> WanPipeline:
    return WanPipeline(
        tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )  # fmt: skip


def test_prompt_embeds_equal_wan_pipeline(t2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN))
    expected, _ = t2v_pipeline(model).encode_prompt(
        PROMPTS, do_classifier_free_guidance=False, max_sequence_length=MAX_LEN, device=torch.device("cpu")
    )
    ours = model.encode_prompts(PROMPTS)
    assert ours.shape == (3, MAX_LEN, 32)
    assert torch.equal(ours, expected)
    # The pipeline zero-pads past each prompt's tokens; prompts of different length make that visible.
    assert ours[0, -1].abs().sum() == 0 and ours[2, -1].abs().sum() > 0
    empty, _ = t2v_pipeline(model).encode_prompt(
        [""], do_classifier_free_guidance=False, max_sequence_length=MAX_LEN
    )
    assert torch.equal(model.empty_prompt_embeds(), empty)


def test_get_condition_and_frozen_models(t2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN))
    for module in (model.text_encoder, model.vae):
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())
    with torch.enable_grad():
        cond = model.get_condition(PROMPTS[:2], videos())
    assert [tuple(t.shape) for t in cond["latent_params"]] == [(1, 8, 2, 2, 2), (1, 8, 1, 2, 4)]
    assert [tuple(t.shape) for t in cond["prompt_embeds"]] == [(1, MAX_LEN, 32)] * 2
    assert all(t.grad_fn is None and not t.requires_grad for ts in cond.values() for t in ts)
    # latent_params are the VAE posterior's parameters for the same clip.
    direct = model.vae.encode(videos()[0][None]).latent_dist.parameters
    assert torch.equal(cond["latent_params"][0], direct)
    with torch.enable_grad():
        inputs = model.process_condition(cond, dp_generator(0, 0))
    assert all(t.grad_fn is None for ts in inputs.values() for t in ts)


def test_normalize_latents_equals_pipeline_inverse(t2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(t2v_dir)
    cfg = model.vae.config
    z = torch.randn(2, 4, 3, 2, 2, generator=torch.Generator().manual_seed(2))
    normalised = normalize_latents(z, cfg)
    expected = (z - torch.tensor([0.1, -0.2, 0.3, 0.05]).view(1, 4, 1, 1, 1)) / torch.tensor(
        [1.5, 0.5, 2.0, 1.25]
    ).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(normalised, expected, rtol=1e-6, atol=1e-6)
    # WanPipeline's decode undoes it: latents / (1 / std) + mean.
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, 4, 1, 1, 1)
    mean = torch.tensor(cfg.latents_mean).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(normalised / inv_std + mean, z, rtol=1e-6, atol=1e-6)


def test_process_condition_flow_matching(t2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(
        t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN, latent_sample_mode="mode")
    )
    cond = model.get_condition(PROMPTS[:2], videos())
    out = model.process_condition(cond, dp_generator(3, 1))
    assert set(out) == {"hidden_states", "timestep", "encoder_hidden_states", "latents", "training_target"}
    schedule = FlowMatchingSchedule(1000, 3.0)
    assert model.schedule == schedule
    table = schedule.timesteps()
    for i in range(2):
        mean = cond["latent_params"][i][:, :4]
        assert torch.equal(out["latents"][i], normalize_latents(mean, model.vae.config))
        t = out["timestep"][i]
        assert t.shape == (1,) and bool((table == t).any())
        sigma = schedule.sigmas()[table == t]
        noise = out["training_target"][i] + out["latents"][i]
        torch.testing.assert_close(out["hidden_states"][i], add_noise(out["latents"][i], noise, sigma))
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        torch.testing.assert_close(
            out["hidden_states"][i], scheduler.scale_noise(out["latents"][i], t, noise), rtol=0, atol=1e-6
        )
        assert torch.equal(out["encoder_hidden_states"][i], cond["prompt_embeds"][i])


def test_process_condition_is_seeded(t2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN))
    cond = model.get_condition(PROMPTS[:2], videos())
    a = model.process_condition(cond, dp_generator(5, 0))
    b = model.process_condition(cond, dp_generator(5, 0))
    c = model.process_condition(cond, dp_generator(5, 1))
    for key in a:
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key
    assert not torch.equal(a["training_target"][0], c["training_target"][0])
    # latent_sample_mode="sample" draws from the posterior: latents differ from its normalised mean.
    mean = normalize_latents(cond["latent_params"][0][:, :4], model.vae.config)
    assert not torch.equal(a["latents"][0], mean)


def test_prompt_dropout(t2v_dir: Path) -> None:
    always = WanConditionModel.from_pretrained(
        t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN, prompt_dropout_prob=1.0)
    )
    cond = always.get_condition(PROMPTS[:2], videos())
    out = always.process_condition(cond, dp_generator(0, 0))
    assert all(torch.equal(e, always.empty_prompt_embeds()) for e in out["encoder_hidden_states"])
    half = WanConditionModel.from_pretrained(
        t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN, prompt_dropout_prob=0.5)
    )
    cond = half.get_condition(PROMPTS[:1] * 64, [videos()[1]] * 64)
    dropped = sum(
        torch.equal(e, half.empty_prompt_embeds())
        for e in half.process_condition(cond, dp_generator(0, 0))["encoder_hidden_states"]
    )
    assert 16 < dropped < 48


def test_i2v_condition_equals_pipeline(i2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(
        i2v_dir, WanConditionConfig(mode="i2v", max_sequence_length=MAX_LEN)
    )
    clip = videos()[0]
    pipe = WanImageToVideoPipeline(
        tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), image_processor=model.image_processor,
        image_encoder=model.image_encoder,
    )  # fmt: skip
    _, expected = pipe.prepare_latents(
        clip[:, 0][None],
        1,
        4,
        16,
        16,
        5,
        torch.float32,
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )
    (ours,) = model.encode_first_frames([clip])
    assert ours.shape == (1, 8, 2, 2, 2)
    assert torch.equal(ours, expected)
    pixels = ((clip[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    expected_embeds = pipe.encode_image(Image.fromarray(pixels), torch.device("cpu"))
    (embeds,) = model.encode_images([clip[:, 0]])
    torch.testing.assert_close(embeds, expected_embeds, rtol=1e-5, atol=1e-5)
    cond = model.get_condition(PROMPTS[:1], [clip])
    out = model.process_condition(cond, dp_generator(0, 0))
    # The transformer input is [noisy latents (4) | mask (4) | first-frame latents (4)] on channels.
    assert out["hidden_states"][0].shape == (1, 12, 2, 2, 2)
    assert torch.equal(out["hidden_states"][0][:, 4:], ours)
    assert torch.equal(out["encoder_hidden_states_image"][0], cond["image_embeds"][0])
    assert not any(p.requires_grad for p in model.image_encoder.parameters())


def test_missing_components_are_named(t2v_dir: Path, i2v_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "wan"
    shutil.copytree(t2v_dir, root)
    shutil.rmtree(root / "vae")
    shutil.rmtree(root / "tokenizer")
    with pytest.raises(ConditionCheckpointError, match=r"lacks condition components") as err:
        WanConditionModel.from_pretrained(root)
    assert str(root) in str(err.value)
    assert "vae/config.json (the AutoencoderKLWan VAE)" in str(err.value)
    assert "tokenizer/tokenizer_config.json" in str(err.value)
    assert "text_encoder" not in str(err.value).split(":", 1)[1]
    i2v_root = tmp_path / "wan_i2v"
    shutil.copytree(i2v_dir, i2v_root)
    shutil.rmtree(i2v_root / "image_encoder")
    with pytest.raises(ConditionCheckpointError, match=r"image_encoder/config.json \(the CLIPVisionModel"):
        WanConditionModel.from_pretrained(i2v_root, WanConditionConfig(mode="i2v"))
    with pytest.raises(ConditionCheckpointError, match="does not exist"):
        WanConditionModel.from_pretrained(tmp_path / "nowhere")


def test_pipeline_kind_must_match_mode(t2v_dir: Path, i2v_dir: Path, tmp_path: Path) -> None:
    assert json.loads((t2v_dir / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    with pytest.raises(
        ConditionCheckpointError, match="a WanImageToVideoPipeline checkpoint serves mode 'i2v'"
    ):
        WanConditionModel.from_pretrained(i2v_dir)  # the default mode is t2v
    root = tmp_path / "wan"
    shutil.copytree(t2v_dir, root)
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps(index | {"_class_name": "WanVACEPipeline"}))
    with pytest.raises(ConditionCheckpointError, match="'WanVACEPipeline' is not supported"):
        WanConditionModel.from_pretrained(root)
    # Wan2.2 reuses WanPipeline: two experts split at boundary_ratio, or per-token timesteps. Null entries, as
    # diffusers writes them for Wan2.1, are fine.
    wan21 = index | {"transformer_2": [None, None], "boundary_ratio": None, "expand_timesteps": False}
    (root / "model_index.json").write_text(json.dumps(wan21))
    WanConditionModel.from_pretrained(root)
    experts = wan21 | {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}
    for wan22, named in (
        (experts, r"transformer_2=\['diffusers'"),
        (wan21 | {"expand_timesteps": True}, "expand"),
    ):
        (root / "model_index.json").write_text(json.dumps(wan22))
        with pytest.raises(ConditionCheckpointError, match=f"a Wan2.2 pipeline \\({named}"):
            WanConditionModel.from_pretrained(root)


def test_single_model_dirs_are_refused(t2v_dir: Path) -> None:
    # A transformers checkpoint (model_type at the root) is not a Wan pipeline directory.
    with pytest.raises(ConditionCheckpointError, match=r"transformers checkpoint \(model_type 'umt5'\)"):
        WanConditionModel.from_pretrained(t2v_dir / "text_encoder")
    with pytest.raises(ConditionCheckpointError, match=r"single diffusers model \('AutoencoderKLWan'\)"):
        WanConditionModel.from_pretrained(t2v_dir / "vae")


def test_wrong_component_classes(t2v_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "wan"
    shutil.copytree(t2v_dir, root)
    cfg = json.loads((root / "text_encoder" / "config.json").read_text())
    (root / "text_encoder" / "config.json").write_text(json.dumps(cfg | {"model_type": "t5"}))
    with pytest.raises(ConditionCheckpointError, match="model_type 't5', expected 'umt5'"):
        WanConditionModel.from_pretrained(root)


def test_bad_videos(t2v_dir: Path) -> None:
    model = WanConditionModel.from_pretrained(t2v_dir, WanConditionConfig(max_sequence_length=MAX_LEN))
    with pytest.raises(ValueError, match=r"videos\[0\] has F=4, H=16, W=16; the Wan VAE needs F = 1 \+ 4k"):
        model.encode_videos([torch.zeros(3, 4, 16, 16)])
    with pytest.raises(ValueError, match=r"videos\[1\] has F=1, H=12"):
        model.encode_videos([torch.zeros(3, 1, 16, 16), torch.zeros(3, 1, 12, 16)])
    with pytest.raises(ValueError, match=r"must be \[3, F, H, W\]"):
        model.encode_videos([torch.zeros(1, 3, 1, 16, 16)])
    with pytest.raises(ValueError, match="2 prompts but 1 videos"):
        model.get_condition(PROMPTS[:2], videos()[:1])


@pytest.mark.parametrize("mode", ["t2v", "i2v"])
def test_inputs_feed_wan_transformer(mode: str, t2v_dir: Path, i2v_dir: Path) -> None:
    """process_condition's keys are WanTransformer3DModel.forward's arguments, and a prediction of its shape
    gives a per-sample MSE against training_target with gradients only in the transformer."""
    from diffusers import WanTransformer3DModel

    root = i2v_dir if mode == "i2v" else t2v_dir
    # I2V: Wan's cross-attention takes the context's last 512 tokens as the prompt and the rest as CLIP tokens,
    # so only a 512-token prompt gives it the layout it splits at.
    model = WanConditionModel.from_pretrained(
        root, WanConditionConfig(mode=mode, max_sequence_length=512 if mode == "i2v" else MAX_LEN)
    )
    extra = dict(image_dim=16, added_kv_proj_dim=24) if mode == "i2v" else {}
    dit = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12 if mode == "i2v" else 4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32, **extra,
    )  # fmt: skip
    inputs = model.process_condition(model.get_condition(PROMPTS[:2], videos()), dp_generator(0, 0))
    targets, latents = inputs.pop("training_target"), inputs.pop("latents")
    image_tokens = []
    if mode == "i2v":
        clip = model.image_encoder.config
        want_image_tokens = (clip.image_size // clip.patch_size) ** 2 + 1
        dit.blocks[0].attn2.add_k_proj.register_forward_hook(
            lambda m, args, out: image_tokens.append(args[0].shape[1])
        )
    for i in range(2):
        sample = {key: values[i] for key, values in inputs.items()}
        pred = dit(**sample, return_dict=False)[0]
        assert pred.shape == targets[i].shape == latents[i].shape
        loss = torch.nn.functional.mse_loss(pred, targets[i])
        loss.backward()
    assert all(p.grad is not None for p in dit.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.text_encoder.parameters())
    if mode == "i2v":
        assert image_tokens == [want_image_tokens] * 2  # the CLIP tokens, and only they, reach the image path


@pytest.mark.cuda
def test_cuda_models_with_cpu_generator_match_cpu(i2v_dir: Path) -> None:
    """Condition models on the GPU, generator on the CPU (dp_generator's default): the same draws as on the
    CPU, so the inputs agree up to kernel rounding."""
    config = WanConditionConfig(mode="i2v", max_sequence_length=MAX_LEN, prompt_dropout_prob=0.5)
    cpu = WanConditionModel.from_pretrained(i2v_dir, config)
    gpu = WanConditionModel.from_pretrained(i2v_dir, config, device="cuda")
    ref = cpu.process_condition(cpu.get_condition(PROMPTS[:2], videos()), dp_generator(1, 0))
    # cuDNN convolutions (the VAE's) default to TF32 on CUDA: fp32 here, so only kernel rounding differs.
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        out = gpu.process_condition(gpu.get_condition(PROMPTS[:2], videos()), dp_generator(1, 0))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    for key in ref:
        for a, b in zip(ref[key], out[key], strict=True):
            assert b.device.type == "cuda", key
            torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)
