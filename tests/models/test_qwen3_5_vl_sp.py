"""Qwen3.5 and Qwen3.5-MoE VLMs under Ulysses SP (ViT + hybrid LM: Gated DeltaNet over heads, gated attention) on
real gloo ranks, against the same model unsliced: the Qwen3-VL SP test's case runner (test_qwen3_vl_sp.py) with
these models. The micro-batch puts its only image in the first rank's slice, so the other rank's tokens carry no
visual feature; neither the sequence length nor the patch count divides by the SP size.

The MoE model runs without its aux loss here (an SP-global statistic that every rank adds to its own loss: the
trainer adds it once, tests/train/test_vlm_moe_train.py covers that path for Qwen3-VL-MoE).
"""

from __future__ import annotations

import pytest
import torch
from test_qwen3_5_vl import EAGER_OPS, tiny_config
from test_qwen3_vl_sp import _sp_case

from veomni.kernels import OpsConfig
from veomni.models.hf.attention import register_hf_attention
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.qwen3_5.generated import patched_modeling_qwen3_5 as ours
from veomni.models.qwen3_5_moe.generated import patched_modeling_qwen3_5_moe as ours_moe


def _build(moe: bool) -> torch.nn.Module:
    register_hf_attention()
    torch.manual_seed(0)
    config = tiny_config(moe, output_router_logits=False) if moe else tiny_config()
    config.text_config.use_cache = False  # the case runner calls the model as the trainer does, minus this flag
    cls = ours_moe.Qwen3_5MoeForConditionalGeneration if moe else ours.Qwen3_5ForConditionalGeneration
    model = cls(config)
    with torch.no_grad():  # random (1 + w) text norms, as in test_qwen3_5_vl
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and ".visual." not in name:
                p.normal_(0, 0.1)
    # The Gated DeltaNet's SP path is the kernel path (upstream's forward has no head exchange).
    apply_ops(model, OpsConfig(attention="sdpa", **EAGER_OPS))
    return model


def dense_model() -> torch.nn.Module:
    return _build(moe=False)


def moe_model() -> torch.nn.Module:
    return _build(moe=True)


@pytest.mark.parametrize("factory", [dense_model, moe_model], ids=["dense", "moe"])
def test_sp2_with_the_image_on_one_rank_equals_one_process(dist_pools, factory):
    results = dist_pools.get(2).run(_sp_case, "image_in_first_slice_only", 4, factory=factory)
    for r in results:
        assert r["patches"] % 8 and r["full_len"] % 2  # the uneven case is what runs
        assert not r["missing"], r["missing"]  # every parameter, the tower's included, got a gradient
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        assert r["worst_grad"] <= 1.0, r["worst_grad"]
    assert [r["local_visual"] > 0 for r in results] == [True, False]
