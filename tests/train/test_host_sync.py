"""A training step queues its work without making the host wait for the device (issue 22 item 2).

CPU: `HostSyncCounter` records every ATen call that would stall the host on a GPU; a dense packed step records
none. GPU: the same step under ``torch.cuda.set_sync_debug_mode("error")``, dense and MoE.
"""

from __future__ import annotations

import pytest
import torch
from test_loop import DENSE, MOE, tiny_recipe
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.masking_utils import find_packed_sequence_indices

from veomni.core.host_sync import HostSyncCounter
from veomni.kernels import OpsConfig
from veomni.models.hf.attention import hf_attention_name, packed_kwargs, register_hf_attention
from veomni.train.loop import build_run
from veomni.train.recipe import recipe_from_dict
from veomni.train.step import read_stats, train_step_on_device


def test_counter_sees_each_kind_of_sync():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item()
        bool(x[0] > 1)
        x.nonzero()
        x[x > 2]
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # size given: no sync
        x.add(1).mul(2).cumsum(0)  # queued work: no sync
    assert syncs.counts == {"_local_scalar_dense": 2, "nonzero": 1, "index": 1, "repeat_interleave": 1}, (
        syncs.report()
    )


def _packed_row(seq: int, docs: tuple[int, ...]) -> dict:
    position_ids = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    assert position_ids.shape[1] == seq
    return {"position_ids": position_ids, **packed_kwargs(position_ids)}


def test_hf_mask_builder_syncs_where_ours_does_not(tmp_path):
    """The yardstick: plain transformers with a veomni attention looks for packing in ``position_ids`` (a host
    read per forward); the same forward through veomni's patched modeling file reads nothing."""
    register_hf_attention()
    config = Qwen3Config(**{k: v for k, v in DENSE.items() if k != "model_type"})
    torch.manual_seed(0)
    upstream = AutoModelForCausalLM.from_config(config, attn_implementation=hf_attention_name("sdpa"))
    assert upstream.config._attn_implementation == hf_attention_name("sdpa")
    row = _packed_row(48, (20, 28))
    ids = torch.randint(0, DENSE["vocab_size"], (1, 48))
    with HostSyncCounter() as probe:
        find_packed_sequence_indices(row["position_ids"])
    assert probe.counts["_local_scalar_dense"] == 1
    with HostSyncCounter() as theirs:
        upstream(input_ids=ids, use_cache=False, **row)
    assert theirs.counts["_local_scalar_dense"] >= 1, theirs.report()

    from veomni.models.build import build_model

    eager = dict.fromkeys(("cross_entropy", "rms_norm", "rope", "swiglu"), "eager")  # also on a GPU host
    ours = build_model(config, ops=OpsConfig(attention="sdpa", compile="off", **eager), init_device="cpu")
    ours.load_state_dict(upstream.state_dict())
    with HostSyncCounter() as syncs:
        got = ours(input_ids=ids, use_cache=False, **row).logits
    assert not syncs.counts, syncs.report()
    torch.testing.assert_close(got, upstream(input_ids=ids, use_cache=False, **row).logits, rtol=0, atol=0)


def test_dense_train_step_never_waits_for_the_device(tmp_path):
    run = build_run(recipe_from_dict(tiny_recipe(str(tmp_path), DENSE, steps=2)))
    batches = iter(run.train_data)
    step = next(batches)
    assert (
        len(step.micro_batches) > 1 and step.micro_batches[0]["cu_seqlens"].numel() > 2
    )  # packed, accumulated
    with HostSyncCounter() as syncs:
        lazy = train_step_on_device(run, step)
    assert not syncs.counts, syncs.report()
    (stats,) = read_stats([lazy])
    assert stats["loss"] > 0 and stats["grad_norm"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_gpu_train_step_has_no_synchronizing_call(tmp_path, model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    raw = tiny_recipe(str(tmp_path), model, steps=3)
    raw["ops"] = {}  # the CUDA defaults (Triton experts for the MoE model)
    raw["train"]["device"] = "cuda"
    raw["model"]["dtype"] = "bfloat16"
    run = build_run(recipe_from_dict(raw))
    batches = iter(run.train_data)
    read_stats([train_step_on_device(run, next(batches))])  # warm-up: lazy kernel set-up may read the device
    step = next(batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lazy = train_step_on_device(run, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (stats,) = read_stats([lazy])
    assert stats["loss"] > 0
