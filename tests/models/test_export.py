"""Export: FSDP / EP sharded models and DCP checkpoints -> HF safetensors that plain transformers loads with
identical logits, in the key layout transformers' own save_pretrained writes (per-expert keys for Qwen3-MoE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import backend_params
from loading_fixtures import eager_ops, save_hf, state, token_batch
from transformers import AutoModelForCausalLM

from veomni.models.build import build_model
from veomni.models.export.cli import main as export_cli
from veomni.models.export.hf import export_dcp_to_hf, export_hf
from veomni.models.loading import CheckpointMismatchError
from veomni.models.loading.safetensors_io import CheckpointFiles


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_src")
    save_hf("dense", root / "dense_tied", seed=5, tie=True)
    save_hf("moe", root / "moe4", seed=6, num_experts=4)
    save_hf("moe", root / "moe6", seed=7, num_experts=6)
    return {name: str(root / name) for name in ("dense_tied", "moe4", "moe6")}


def keys_of(path: str) -> set[str]:
    with CheckpointFiles(path) as files:
        return set(files.tensors)


def logits(path: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(token_batch()).logits


def assert_same_hf_checkpoint(src: str, out: str) -> None:
    """``out`` holds the keys transformers' save_pretrained wrote to ``src`` and loads to identical logits."""
    assert keys_of(out) == keys_of(src)
    assert torch.equal(logits(out), logits(src))
    config = json.loads((Path(out) / "config.json").read_text())
    assert config["architectures"] == json.loads((Path(src) / "config.json").read_text())["architectures"]
    assert "veomni" not in json.dumps(config)


def _export(ctx, src: str, out: str, ep: int, max_shard_bytes: int) -> tuple[str, ...]:
    pstate = state(ctx, ep=ep)
    model = build_model(src, weights=src, ops=eager_ops(), parallel_state=pstate)
    return export_hf(model, out, parallel_state=pstate, max_shard_bytes=max_shard_bytes).files


# world size -> (checkpoint, ep, max shard bytes)
EXPORT_CASES = {2: [("dense_tied", 1, 6000), ("moe4", 2, 2**30)], 4: [("moe6", 2, 20000)]}


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4))
def test_sharded_export_loads_in_plain_transformers(dist_pools, ckpts, tmp_path, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    for name, ep, max_bytes in EXPORT_CASES[world_size]:
        out = str(tmp_path / f"{name}_ep{ep}")
        files = pool.run(_export, ckpts[name], out, ep, max_bytes)
        assert files[0] == files[-1]
        if max_bytes < 2**30:
            assert len(files[0]) > 1 and (Path(out) / "model.safetensors.index.json").is_file()
        assert_same_hf_checkpoint(ckpts[name], out)


def test_export_of_a_plain_model(ckpts, tmp_path):
    src = ckpts["moe4"]
    model = build_model(src, weights=src, ops=eager_ops())
    report = export_hf(model, tmp_path / "out", dtype=torch.bfloat16)
    assert report.files == ("model.safetensors",)
    assert keys_of(str(tmp_path / "out")) == keys_of(src)
    with CheckpointFiles(tmp_path / "out") as files:
        assert {t.dtype for t in files.tensors.values()} == {torch.bfloat16}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(src)
    for key, value in ref.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value.to(torch.bfloat16).float()), key


def test_generation_config_travels_from_checkpoint_to_export(ckpts, tmp_path):
    import shutil

    from transformers import GenerationConfig

    src = tmp_path / "src"
    shutil.copytree(ckpts["dense_tied"], src)
    GenerationConfig(do_sample=True, temperature=0.42, top_p=0.9, eos_token_id=[3, 5]).save_pretrained(src)
    model = build_model(str(src), weights=str(src), ops=eager_ops())
    export_hf(model, tmp_path / "out")
    exported = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (exported.do_sample, exported.temperature, exported.top_p) == (True, 0.42, 0.9)
    assert exported.eos_token_id == [3, 5]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.generation_config.temperature == 0.42


def _save_dcp(ctx, src: str, dcp_dir: str, ep: int) -> None:
    model = build_model(src, weights=src, ops=eager_ops(), parallel_state=state(ctx, ep=ep))
    dcp.save({"model": model.state_dict(), "trainer": {"step": torch.tensor(7)}}, checkpoint_id=dcp_dir)


def test_dcp_checkpoint_to_hf(dist_pools, ckpts, tmp_path, capsys):
    pool = dist_pools.get(2)
    for name in ("dense_tied", "moe4"):
        dcp_dir, out = str(tmp_path / f"dcp_{name}"), str(tmp_path / f"hf_{name}")
        pool.run(_save_dcp, ckpts[name], dcp_dir, 1)
        assert (
            export_cli(
                [dcp_dir, out, "--config", ckpts[name], "--prefix", "model.", "--max-shard-size", "40KB"]
            )
            == 0
        )
        assert_same_hf_checkpoint(ckpts[name], out)
    # The model's keys sit under "model."; without the prefix nothing matches, and the error says so.
    assert export_cli([dcp_dir, str(tmp_path / "x"), "--config", ckpts["moe4"]]) == 1
    err = capsys.readouterr().err
    assert "missing keys" in err and "unexpected keys" in err and "trainer.step" in err
    # EP ranks each saved their own experts under the same names: refused with the reason.
    ep_dir = str(tmp_path / "dcp_ep")
    pool.run(_save_dcp, ckpts["moe4"], ep_dir, 2)
    with pytest.raises(CheckpointMismatchError, match="an EP rank's local experts"):
        export_dcp_to_hf(ep_dir, tmp_path / "y", config=ckpts["moe4"], prefix="model.")


def test_a_training_step_directory_points_at_its_dcp_subdirectory(ckpts, tmp_path, capsys):
    # The trainer writes step_N/dcp/ beside trainer.pt; the step directory itself is the natural thing to pass.
    src = ckpts["dense_tied"]
    model = build_model(src, weights=src, ops=eager_ops())
    step = tmp_path / "ckpt" / "step_00000010"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step / "dcp"), no_dist=True)
    out = str(tmp_path / "out")
    assert export_cli([str(step), out, "--config", src, "--prefix", "model."]) == 1
    err = capsys.readouterr().err
    assert "not a torch.distributed.checkpoint directory" in err and f"{step / 'dcp'} holds one" in err
    assert export_cli([str(step / "dcp"), out, "--config", src, "--prefix", "model."]) == 0
    assert_same_hf_checkpoint(src, out)


def test_an_old_checkpoint_exports_with_the_tokenizer_files_beside_its_config(ckpts, tmp_path, caplog):
    # A step directory without hf_files/ (written before the trainer kept its model's files there): the config
    # must be named, and the tokenizer / processor files beside it travel (nothing else there does).
    import logging
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ckpts["dense_tied"], src)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (src / "notes.txt").write_text("not a model file")
    model = build_model(str(src), weights=str(src), ops=eager_ops())
    step = tmp_path / "ckpt" / "step_00000003"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step / "dcp"), no_dist=True)
    with pytest.raises(FileNotFoundError, match=r"hf_files holds no config.json .* pass config="):
        export_dcp_to_hf(step / "dcp", tmp_path / "x", prefix="model.")
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="veomni.models.export.files"):
        export_dcp_to_hf(step / "dcp", out, config=src, prefix="model.")
    assert f"config from {src}" in caplog.text and "an older checkpoint" in caplog.text
    assert {p.name for p in out.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "chat_template.jinja", "tokenizer_config.json",
    }  # fmt: skip
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert_same_hf_checkpoint(str(src), str(out))


def test_dcp_export_keeps_strict_fp32_tensors_and_the_generation_config(tmp_path):
    # As export_hf (and save_pretrained): DeepSeek-V3's router bias stays fp32 under dtype=bf16, and the
    # config directory's generation_config.json travels with the export.
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, GenerationConfig

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    model = build_model(config, ops=eager_ops())
    with torch.no_grad():
        model.get_buffer(bias).copy_(torch.linspace(0.1, 0.3, 4) + 1e-4)  # not representable in bf16
    want = model.get_buffer(bias).detach().clone()
    config.save_pretrained(tmp_path / "config")
    GenerationConfig(eos_token_id=[3, 5], temperature=0.42, do_sample=True).save_pretrained(
        tmp_path / "config"
    )
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_dcp_to_hf(tmp_path / "dcp", tmp_path / "out", config=tmp_path / "config", prefix="model.",
                     dtype=torch.bfloat16)  # fmt: skip
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors[bias].dtype == torch.float32 and torch.equal(tensors[bias], want)
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (generation.eos_token_id, generation.temperature) == ([3, 5], 0.42)


def _train_step_and_export(ctx, src: str, out: str, lr: float) -> float:
    model = build_model(src, weights=src, ops=eager_ops(), parallel_state=state(ctx))
    ids = token_batch()
    loss = model(
        input_ids=ids, labels=ids
    ).loss  # every rank the same batch: FSDP's average is that batch's grad
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    export_hf(model, out)
    return float(loss)


def test_transformers_moe_checkpoint_round_trips_through_a_training_step(dist_pools, tmp_path):
    """The issue's acceptance test: save_pretrained (per-expert) -> our loader -> one step -> our export -> plain HF."""
    src, out, lr = tmp_path / "src", tmp_path / "out", 0.5
    ref = save_hf("moe", src, seed=11, num_experts=4)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys_of(
        str(src)
    )  # transformers writes per-expert keys
    losses = dist_pools.get(2).run(_train_step_and_export, str(src), str(out), lr)
    ids = token_batch()
    ref.train()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    assert losses[0] == losses[1] and abs(losses[0] - float(ref_loss.detach())) < 1e-6
    assert keys_of(str(out)) == keys_of(str(src))
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)
        assert not torch.equal(exported(ids).logits, AutoModelForCausalLM.from_pretrained(src)(ids).logits)
