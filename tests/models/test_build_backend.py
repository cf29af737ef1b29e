"""build_model(backend="hf"): transformers' own class, unpatched, FSDP2 only; what it cannot do is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from dist_harness import backend_params
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM as UpstreamQwen3

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.hf.kernel_hooks import ATTR


def tiny_qwen3() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip


def test_hf_backend_builds_the_unpatched_transformers_class_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="veomni.models.build"):
        model = build_model(tiny_qwen3(), backend="hf")
    assert type(model) is UpstreamQwen3  # registered model type, yet transformers' own class
    assert not any(hasattr(m, ATTR) for m in model.modules())
    assert model.config._attn_implementation == "sdpa"  # HF's choice, not a veomni_* backend
    text = caplog.text
    assert "build_model(backend='hf'): training transformers' own Qwen3ForCausalLM, unpatched" in text
    for off in ("veomni kernels", "veomni attention", "no Ulysses SP", "expert parallelism", "Only FSDP2"):
        assert off in text


def test_veomni_backend_stays_the_default():
    model = build_model(tiny_qwen3(), ops=OpsConfig())
    assert type(model).__module__ == "veomni.models.qwen3.generated.patched_modeling_qwen3"
    assert hasattr(model.model.layers[0], ATTR)


def test_backend_arguments_are_checked():
    with pytest.raises(ValueError, match="backend='hf'\\) binds no veomni kernels, so it takes no OpsConfig"):
        build_model(tiny_qwen3(), ops=OpsConfig(), backend="hf")
    with pytest.raises(ValueError, match="backend must be 'veomni' or 'hf', got 'liger'"):
        build_model(tiny_qwen3(), ops=OpsConfig(), backend="liger")
    with pytest.raises(TypeError, match="ops must be a veomni.kernels.OpsConfig, got NoneType"):
        build_model(tiny_qwen3())


def test_a_task_the_model_lacks_names_its_tasks():
    with pytest.raises(ValueError) as err:
        build_model(tiny_qwen3(), ops=OpsConfig(), task="image_text_to_text")
    text = str(err.value)
    assert "model_type 'qwen3' does not support task 'image_text_to_text'" in text and "'causal_lm'" in text
    with pytest.raises(
        ValueError, match="model_type 'qwen3' does not support task 'any_to_any'.*'causal_lm'"
    ):
        build_model(tiny_qwen3(), backend="hf", task="any_to_any")


# ---------------------------------------------------------------- FSDP2 on real ranks


def _hf_fsdp_step(ctx, weights: str, sp: int) -> dict:
    dims = ParallelDims(dp_shard=ctx.world_size // sp, sp=sp)
    state = build_parallel_state(dims, ctx.device_type)
    if sp > 1:
        try:
            build_model(weights, weights=weights, backend="hf", parallel_state=state)
        except ValueError as err:
            return {"error": str(err)}
        return {"error": None}
    model = build_model(weights, weights=weights, backend="hf", parallel_state=state)
    ids = torch.arange(12, device=ctx.device).reshape(1, 12) % 64
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    from torch.distributed.tensor import DTensor

    return {
        "upstream": isinstance(model, UpstreamQwen3),  # FSDP2 subclasses the model's class
        "patched": any("veomni" in c.__module__ for c in type(model).__mro__),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "loss": float(loss.detach()),
        "kernels": any(hasattr(m, ATTR) for m in model.modules()),
    }


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_hf_backend_trains_under_fsdp2_and_refuses_sp(dist_pools, tmp_path, world_size, backend):
    torch.manual_seed(0)
    reference = UpstreamQwen3(tiny_qwen3())
    reference.save_pretrained(tmp_path)
    ids = torch.arange(12).reshape(1, 12) % 64
    want = float(reference(input_ids=ids, labels=ids).loss.detach())
    pool = dist_pools.get(world_size, backend)
    for result in pool.run(_hf_fsdp_step, str(tmp_path), 1):
        assert result["upstream"] and not result["patched"]
        assert result["sharded"] and not result["kernels"]
        assert result["loss"] == pytest.approx(want, rel=1e-5)
    for result in pool.run(_hf_fsdp_step, str(tmp_path), 2):
        assert "no Ulysses sequence parallelism (sp=2" in result["error"]


def _fallback_vlm_under_sp(ctx) -> str | None:
    from transformers import LlavaConfig

    from veomni.kernels import OpsConfig

    # An unregistered VLM (qwen2_vl is registered with veomni now, with its own ViT SP).
    state = build_parallel_state(ParallelDims(dp_shard=1, sp=ctx.world_size), ctx.device_type)
    config = LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8, "patch_size": 4},
    )  # fmt: skip
    try:
        build_model(config, ops=OpsConfig(), parallel_state=state, task="image_text_to_text")
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_a_fallback_vlm_is_refused_under_sp(dist_pools, world_size, backend):
    for error in dist_pools.get(world_size, backend).run(_fallback_vlm_under_sp):
        assert error is not None and "LlavaForConditionalGeneration" in error
        assert "does not support Ulysses sequence parallelism" in error and "sp=2" in error
