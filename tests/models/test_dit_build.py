"""Diffusers' WanTransformer3DModel through veomni: diffusers' save_pretrained -> build_model (1 and 2 ranks,
FSDP2, both load modes) -> the tensors and outputs of WanTransformer3DModel.from_pretrained; export_diffusers ->
from_pretrained gives the same state dict, outputs and the config.json diffusers writes; a checkpoint of the
other library is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_harness import backend_params
from loading_fixtures import eager_ops, gather_state_dict, save_hf, state

from veomni.models.build import build_model
from veomni.models.diffusers.build import CheckpointKindError
from veomni.models.diffusers.export import export_diffusers
from veomni.models.export.hf import export_hf

# The diffusers extra is optional: without it these tests skip rather than fail to collect.
WanTransformer3DModel = pytest.importorskip("diffusers").WanTransformer3DModel

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A latent video [B=2, C=4, F=3, H=8, W=8], timesteps [2] and text embeddings [2, 5, 16] (fp32)."""
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, 4, 3, 8, 8, generator=g),
        torch.tensor([500, 20]),
        torch.randn(2, 5, 16, generator=g),
    )


def forward(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs()).sample


def from_pretrained(path: str) -> WanTransformer3DModel:
    """diffusers' own load, with every parameter copied into fresh memory.

    diffusers leaves parameters in the safetensors mmap (8-byte aligned), and CPU GEMMs round differently
    on differently aligned inputs (its own model changes its output by ~1e-7 when the parameters are cloned).
    Fresh allocations make the comparison with veomni's (freshly allocated) shards bitwise.
    """
    model = WanTransformer3DModel.from_pretrained(path)
    for p in model.parameters():
        p.data = p.data.clone()
    return model


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("wan_src")
    torch.manual_seed(11)
    WanTransformer3DModel(**TINY).save_pretrained(str(root))
    return str(root)


def test_single_process_build_matches_from_pretrained(wan):
    ours = build_model(wan, weights=wan)
    ref = from_pretrained(wan)
    assert type(ours) is WanTransformer3DModel
    theirs = ref.state_dict()
    assert ours.state_dict().keys() == theirs.keys()
    for key, value in ours.state_dict().items():
        assert value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]), key
    # Non-persistent rotary tables: recomputed on the CPU at construction, restored after meta allocation.
    for (name, buf), (name_ref, buf_ref) in zip(ours.named_buffers(), ref.named_buffers(), strict=True):
        assert name == name_ref and buf.dtype == buf_ref.dtype and torch.equal(buf, buf_ref), name
    assert torch.equal(forward(ours), forward(ref))


def test_export_round_trips_through_diffusers(wan, tmp_path):
    ours = build_model(wan, weights=wan)
    report = export_diffusers(ours, tmp_path / "out")
    assert report.files == ("diffusion_pytorch_model.safetensors",)
    # Byte for byte the config diffusers' save_pretrained wrote: nothing of veomni's in it.
    assert (tmp_path / "out" / "config.json").read_bytes() == (Path(wan) / "config.json").read_bytes()
    back = from_pretrained(str(tmp_path / "out"))
    ref = from_pretrained(wan)
    assert back.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert torch.equal(forward(back), forward(ref))


def test_export_hf_dispatches_and_shards_with_an_index(wan, tmp_path):
    ours = build_model(wan, weights=wan)
    out = tmp_path / "sharded"
    (out).mkdir()
    (out / "diffusion_pytorch_model.safetensors").write_bytes(b"stale")  # an older, unsharded export
    report = export_hf(ours, out, max_shard_bytes=20000)
    assert len(report.files) > 1
    assert all(f.startswith("diffusion_pytorch_model-") for f in report.files)
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours.state_dict())
    assert not (out / "diffusion_pytorch_model.safetensors").exists()
    back = from_pretrained(str(out))
    assert torch.equal(forward(back), forward(from_pretrained(wan)))


def test_no_weights_is_diffusers_init_with_a_warning(wan, caplog):
    torch.manual_seed(11)
    with caplog.at_level("WARNING"):
        ours = build_model(wan)
    assert "no weights given" in caplog.text and "diffusers' own __init__" in caplog.text
    # Same seed as the saved model: diffusers' __init__ draws the same values.
    ref = from_pretrained(wan)
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_transformers_checkpoint_for_a_diffusers_model_is_refused(wan, tmp_path):
    hf = tmp_path / "hf"
    save_hf("dense", hf, seed=1)
    with pytest.raises(
        CheckpointKindError, match=r"transformers checkpoint \(model_type .*diffusion_pytorch_model"
    ):
        build_model(wan, weights=hf)
    with pytest.raises(
        CheckpointKindError, match=r"diffusers checkpoint \(_class_name 'WanTransformer3DModel'\)"
    ):
        build_model(hf, weights=wan, ops=eager_ops())


def test_diffusers_model_refuses_ops_under_the_hf_backend_and_a_transformers_task(wan):
    with pytest.raises(ValueError, match="takes no OpsConfig"):
        build_model(wan, weights=wan, ops=eager_ops(), backend="hf")
    with pytest.raises(ValueError, match="does not support task 'causal_lm'"):
        build_model(wan, weights=wan, task="causal_lm")


def _build_compare_export(ctx, src: str, out: str, load_mode: str) -> dict:
    pstate = state(ctx)
    model = build_model(src, weights=src, parallel_state=pstate, load_mode=load_mode)
    blocks = [
        name for name, m in model.named_modules() if type(m).__name__.startswith("FSDPWanTransformerBlock")
    ]
    full = gather_state_dict(model, pstate)
    # cuDNN convolutions default to TF32 on CUDA (the patch embedding): fp32 here, to compare with the CPU run.
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        with torch.no_grad():
            out_sample = model(*inputs()).sample
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    export_diffusers(model, out, parallel_state=pstate)
    return {"blocks": blocks, "state": full, "sample": out_sample}


@pytest.mark.parametrize("world_size, backend", backend_params(2))
@pytest.mark.parametrize("load_mode", ["sharded", "rank0_broadcast"])
def test_fsdp2_build_and_export_match_diffusers(dist_pools, wan, tmp_path, world_size, backend, load_mode):
    out = str(tmp_path / "out")
    results = dist_pools.get(world_size, backend).run(_build_compare_export, wan, out, load_mode)
    ref = from_pretrained(wan)
    expected = forward(ref)
    for r in results:
        assert r["blocks"] == ["blocks.0", "blocks.1"]
        for key, value in ref.state_dict().items():
            assert torch.equal(r["state"][key].cpu(), value), key
        # Each rank ran the whole batch: FSDP2 gathers the same weights, so the same output (GPU fp32 kernels
        # reduce in another order than the CPU reference).
        atol = 1e-6 if backend == "gloo" else 1e-5
        torch.testing.assert_close(r["sample"].cpu(), expected, rtol=0, atol=atol)
    back = from_pretrained(out)
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert (Path(out) / "config.json").read_bytes() == (Path(wan) / "config.json").read_bytes()


def _fresh_build(ctx, src: str) -> dict:
    torch.manual_seed(100 + ctx.rank)  # each rank draws its own values: the build must agree on rank 0's
    pstate = state(ctx)
    model = build_model(src, parallel_state=pstate)
    on = {p.device.type for p in model.parameters()}
    buffers = {name: buf.cpu() for name, buf in model.named_buffers()}
    return {"state": gather_state_dict(model, pstate), "buffers": buffers, "devices": on}


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_fresh_fsdp2_build_holds_rank0s_draws_on_every_rank(dist_pools, wan, world_size, backend):
    results = dist_pools.get(world_size, backend).run(_fresh_build, wan)
    assert all(r["devices"] == {"cuda" if backend == "nccl" else "cpu"} for r in results)
    first = results[0]["state"]
    for r in results[1:]:
        for key, value in first.items():
            assert torch.equal(r["state"][key], value), key
    # The rotary tables are diffusers' own (computed on the CPU) also where the parameters were drawn on a GPU.
    reference = dict(from_pretrained(wan).named_buffers())
    assert reference
    for r in results:
        for name, buf in reference.items():
            assert torch.equal(r["buffers"][name], buf), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fresh_build_on_a_gpu_draws_there_with_diffusers_buffers(wan):
    torch.manual_seed(5)
    ours = build_model(wan, device=torch.device("cuda"))
    torch.manual_seed(5)
    again = build_model(wan, device=torch.device("cuda"))
    reference = from_pretrained(wan)
    for key, value in ours.state_dict().items():
        assert value.device.type == "cuda", key
        assert torch.equal(value, again.state_dict()[key]), key  # seeded: the same draws
    for name, buf in reference.named_buffers():
        assert torch.equal(dict(ours.named_buffers())[name].cpu(), buf), name
