"""build_model + load_weights: FSDP2 / EP shards equal a plain transformers load bit for bit, every byte of the
checkpoint is read exactly once per replica, and every mismatch between checkpoint and model is a clear error."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from dist_harness import backend_params
from loading_fixtures import (
    Qwen3WithOpaqueBuffer,
    dense_config,
    eager_ops,
    gather_state_dict,
    moe_config,
    save_hf,
    state,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from veomni.models.build import build_model
from veomni.models.convert.converters import IncompleteCheckpointError
from veomni.models.loading import CheckpointMismatchError, WrongModelError, load_weights
from veomni.models.loading.safetensors_io import CheckpointFiles
from veomni.models.registry import ModelRegistry


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    paths = {
        "dense_tied": root / "dense_tied",
        "dense_untied": root / "dense_untied",
        "moe4": root / "moe4",
        "moe6": root / "moe6",
    }
    save_hf("dense", paths["dense_tied"], seed=1, max_shard_size="8KB", tie=True)
    save_hf("dense", paths["dense_untied"], seed=2, tie=False)
    save_hf("moe", paths["moe4"], seed=3, max_shard_size="30KB", num_experts=4)
    save_hf("moe", paths["moe6"], seed=4, num_experts=6)
    return {k: str(v) for k, v in paths.items()}


def _file_bytes(path: str) -> int:
    with CheckpointFiles(path) as files:
        return sum(t.materialize().numel() * 4 for t in files.tensors.values())


def _load_case(ctx, path: str, ep: int, mode: str, dp_replicate: int) -> int:
    pstate = state(ctx, ep=ep, dp_replicate=dp_replicate)
    model = build_model(path, weights=path, ops=eager_ops(), parallel_state=pstate, load_mode=mode)
    ref = AutoModelForCausalLM.from_pretrained(path)
    full = gather_state_dict(model, pstate)
    ref_sd = ref.state_dict()
    assert sorted(full) == sorted(ref_sd)
    bad = [k for k in ref_sd if not torch.equal(full[k], ref_sd[k])]
    assert not bad, bad
    # Non-persistent buffers are not in any checkpoint: recomputed after meta construction.
    assert torch.equal(model.model.rotary_emb.inv_freq.cpu(), ref.model.rotary_emb.inv_freq)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == ref.config.tie_word_embeddings
    if ep > 1:
        w = model.model.layers[1].mlp.experts.gate_up_proj
        assert w.to_local().shape[0] <= model.config.num_experts // ep
    # Loading again reports the bytes this rank read: with "sharded", only its own region of each tensor.
    report = load_weights(model, path, mode=mode)
    assert report.mode == mode and set(report.loaded) == set(ref_sd)
    return report.bytes_read


# world size -> (checkpoint, ep, mode, dp_replicate)
LOAD_CASES = {
    1: [("dense_tied", 1, "sharded", 1), ("moe4", 1, "sharded", 1)],
    2: [
        ("dense_untied", 1, "rank0_broadcast", 1),
        ("moe4", 2, "sharded", 1),
        ("moe4", 2, "rank0_broadcast", 1),
        ("moe4", 1, "sharded", 2),  # HSDP: two full replicas, each reading the whole checkpoint
    ],
    # moe6 with ep=2: 3 local experts over ep_fsdp=2, so FSDP shards the experts on dim 1.
    4: [
        ("dense_tied", 1, "sharded", 1),
        ("moe6", 2, "sharded", 1),
        ("moe4", 4, "sharded", 1),
        ("dense_untied", 1, "sharded", 2),
    ],
}


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
def test_sharded_load_equals_transformers_and_reads_each_byte_once(dist_pools, ckpts, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    for name, ep, mode, dp_replicate in LOAD_CASES[world_size]:
        read = pool.run(_load_case, ckpts[name], ep, mode, dp_replicate)
        total = _file_bytes(ckpts[name])
        if mode == "sharded":
            assert sum(read) == total * dp_replicate, (name, read, total)  # no byte read twice in a replica
            if world_size > dp_replicate:  # parameters are sharded: no rank reads everything
                assert max(read) < total
        else:
            assert read == [total] + [0] * (world_size - 1)


def _broadcast_error(ctx, path: str) -> str:
    model = build_model(dense_config(tie=False), ops=eager_ops(), parallel_state=state(ctx))
    with pytest.raises(CheckpointMismatchError, match="missing keys") as err:
        load_weights(model, path, mode="rank0_broadcast")
    return str(err.value)


def test_broadcast_mode_raises_the_same_error_on_every_rank(dist_pools, ckpts):
    messages = dist_pools.get(2).run(_broadcast_error, ckpts["dense_tied"])
    assert all("lm_head.weight" in m for m in messages)  # tied in the checkpoint, untied in this model


def _variant(tmp_path, src: str, name: str, edit) -> str:
    """A copy of the single-file checkpoint ``src`` with its state dict edited by ``edit``."""
    out = tmp_path / name
    out.mkdir()
    shutil.copy(f"{src}/config.json", out / "config.json")
    sd = load_file(f"{src}/model.safetensors")
    edit(sd)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_missing_unexpected_and_misshapen_keys_are_listed(ckpts, tmp_path):
    src = ckpts["dense_untied"]
    missing = _variant(tmp_path, src, "missing", lambda sd: sd.pop("model.norm.weight"))
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \(1\): \['model.norm.weight'\]") as err:
        build_model(src, weights=missing, ops=eager_ops())
    assert err.value.missing == ["model.norm.weight"] and not err.value.unexpected

    extra = _variant(tmp_path, src, "extra", lambda sd: sd.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys \(1\): \['model.extra.weight'\]"):
        build_model(src, weights=extra, ops=eager_ops())
    model = build_model(src, weights=extra, ops=eager_ops(), ignore_unexpected=[r"^model\.extra\."])
    assert torch.equal(model.model.norm.weight, load_file(f"{src}/model.safetensors")["model.norm.weight"])

    # Old checkpoints carry the rotary buffer: known to be harmless, skipped by default.
    rotary = _variant(
        tmp_path,
        src,
        "rotary",
        lambda sd: sd.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
    )
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in load_weights(model, rotary).ignored

    shape = _variant(tmp_path, src, "shape", lambda sd: sd.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"model.norm.weight: the model expects shape \[32\], the checkpoint has \[31\]",
    ):
        build_model(src, weights=shape, ops=eager_ops())


def test_a_checkpoint_of_another_model_is_refused(ckpts, tmp_path):
    llama_dir = tmp_path / "llama"
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    )  # fmt: skip
    llama.save_pretrained(llama_dir)
    model = build_model(dense_config(tie=False), ops=eager_ops())
    with pytest.raises(WrongModelError, match="'llama' model .* the model being loaded is 'qwen3'"):
        load_weights(model, llama_dir)
    # Without the config check the keys still do not add up: Qwen3 has q_norm / k_norm, Llama does not.
    with pytest.raises(CheckpointMismatchError, match="model.layers.0.self_attn.q_norm.weight"):
        load_weights(model, llama_dir, check_config=False)


def test_tied_weights_follow_transformers_rules(ckpts, tmp_path):
    src = ckpts["dense_untied"]  # untied checkpoint: embed and lm_head differ

    def only_head(sd):
        sd.pop("model.embed_tokens.weight")

    head_only = _variant(tmp_path, src, "head_only", only_head)
    (tmp_path / "head_only" / "config.json").write_text(
        json.dumps(
            {**json.loads((tmp_path / "head_only" / "config.json").read_text()), "tie_word_embeddings": True}
        )
    )
    model = build_model(dense_config(tie=True), weights=head_only, ops=eager_ops())
    want = load_file(f"{src}/model.safetensors")["lm_head.weight"]
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(model.lm_head.weight, want)
    # Both present but different while the config ties them: refuse, do not pick one silently.
    with pytest.raises(CheckpointMismatchError, match="ties .* different values"):
        load_weights(model, src, check_config=False)
    same = _variant(
        tmp_path,
        src,
        "same",
        lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone()}),
    )
    load_weights(model, same, check_config=False)


def test_expert_checkpoints_per_expert_fused_and_incomplete(ckpts, tmp_path):
    src = ckpts["moe6"]
    ref = AutoModelForCausalLM.from_pretrained(src)
    # Our own fused layout (transformers' save_original_format=False) passes the per-expert converter untouched.
    fused_dir = tmp_path / "fused"
    ref.save_pretrained(fused_dir, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(f"{fused_dir}/model.safetensors")
    model = build_model(fused_dir, weights=fused_dir, ops=eager_ops())
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())

    gone = "model.layers.2.mlp.experts.4.up_proj.weight"
    holey = _variant(tmp_path, src, "holey", lambda sd: sd.pop(gone))
    with pytest.raises(
        IncompleteCheckpointError,
        match=r"model.layers.2.mlp.experts.gate_up_proj: .*up_proj.weight: missing experts \[4\]",
    ):
        load_weights(model, holey)


def test_bad_paths_and_unmaterialised_models(tmp_path):
    model = build_model(dense_config(), ops=eager_ops())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(model, tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="PyTorch pickle checkpoints are not read"):
        load_weights(model, tmp_path / "empty")
    with torch.device("meta"):
        meta = type(model)(model.config)
    with pytest.raises(ValueError, match="meta device; materialise"):
        load_weights(meta, tmp_path)
    with pytest.raises(ValueError, match="mode must be one of"):
        load_weights(model, tmp_path, mode="fast")


def test_no_weights_means_the_models_own_init_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="veomni.models.build"):
        model = build_model(dense_config(tie=True), ops=eager_ops())
    assert "no weights given" in caplog.text and "_init_weights" in caplog.text
    ref = AutoModelForCausalLM.from_config(dense_config(tie=True))
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed and torch.equal(embed[1], torch.zeros(32))  # padding row, as HF
    assert 0.015 < float(embed[2:].detach().std()) < 0.025  # initializer_range 0.02
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_buffers_that_init_cannot_rebuild_are_an_error():
    reg = ModelRegistry()
    reg.register_model("qwen3", {"causal_lm": "loading_fixtures:Qwen3WithOpaqueBuffer"}, fast_paths=set())
    with pytest.raises(RuntimeError, match=r"non-persistent buffers \['opaque'\] of Qwen3WithOpaqueBuffer"):
        build_model(dense_config(), ops=eager_ops(), registry=reg)
    model = build_model(dense_config(), ops=eager_ops(), registry=reg, init_device="cpu")
    assert isinstance(model, Qwen3WithOpaqueBuffer) and torch.equal(model.opaque, torch.arange(4.0))


def _init_on_shards(ctx) -> bool:
    pstate = state(ctx, ep=2)
    model = build_model(moe_config(), ops=eager_ops(), parallel_state=pstate)
    full = gather_state_dict(model, pstate)
    assert all(torch.isfinite(v).all() for v in full.values())
    assert 0.015 < float(full["model.layers.1.mlp.experts.gate_up_proj"].std()) < 0.025
    dense = build_model(dense_config(tie=True), ops=eager_ops(), parallel_state=state(ctx))
    embed = gather_state_dict(dense, state(ctx))["model.embed_tokens.weight"]
    # HF's init zeroes the padding row of the embedding, here on a row-sharded DTensor; the tied head shares it.
    assert torch.equal(embed[1], torch.zeros(32)) and dense.lm_head.weight is dense.model.embed_tokens.weight
    return 0.015 < float(embed[2:].std()) < 0.025


def test_init_without_weights_on_fsdp_and_ep_shards(dist_pools):
    assert all(dist_pools.get(2).run(_init_on_shards))


def test_a_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    # As from_pretrained: Qwen3Model's keys (`layers.*`, no `model.` prefix) fill Qwen3ForCausalLM; the tied
    # lm_head follows the embedding.
    from transformers import Qwen3Model

    torch.manual_seed(7)
    Qwen3Model(dense_config(tie=True)).save_pretrained(tmp_path)
    model = build_model(dense_config(tie=True), weights=tmp_path, ops=eager_ops())
    ref = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
