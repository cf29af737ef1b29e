"""Qwen2-VL / Qwen2.5-VL through veomni's build path: a checkpoint saved by plain transformers (its original Hub
layout: ``model.layers.*`` and ``visual.*``, no ``language_model`` / ``visual`` sub-model prefixes) loads into the
adapter through the scoped rename recipes, equals ``from_pretrained``, and exports back to identical keys and
tensors that transformers reloads. (FSDP2 / SP / media on some ranks: tests/train/test_vlm_qwen2_train.py.)
"""

from __future__ import annotations

import pytest
import torch
from loading_fixtures import checkpoint_tensors, eager_ops
from test_qwen2_vl import FAMILIES, tiny_config

from veomni.models.build import build_model
from veomni.models.export.hf import export_hf

TASK = "image_text_to_text"


@pytest.mark.parametrize("family", FAMILIES)
def test_original_format_checkpoint_loads_like_transformers_and_exports_back(family, tmp_path):
    _, upstream, ours = FAMILIES[family]
    path = tmp_path / "ckpt"
    torch.manual_seed(3)
    upstream(tiny_config(family)).save_pretrained(path)
    saved = checkpoint_tensors(str(path))
    assert any(k.startswith("visual.blocks.") for k in saved) and any(
        k.startswith("model.layers.") for k in saved
    )

    model = build_model(str(path), weights=str(path), ops=eager_ops(), task=TASK)
    assert type(model) is ours
    ref = upstream.from_pretrained(path)
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]

    export_hf(model, tmp_path / "out")
    exported = checkpoint_tensors(str(tmp_path / "out"))
    assert sorted(exported) == sorted(saved)  # exactly save_pretrained's keys
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    back = upstream.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want)
