"""Finding and opening checkpoint files: diffusers' names, and errors that name the broken file.

A truncated safetensors file or a malformed index must fail with a message naming the file (or shard) and
what is wrong with it, never safetensors' or json's bare error.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from veomni.models.loading import CheckpointFiles, CheckpointMismatchError, load_weights
from veomni.models.loading.safetensors_io import CheckpointFileError


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"0.weight": torch.randn(4, 3, generator=g), "0.bias": torch.randn(4, generator=g)}


def _write_sharded(directory, stem: str, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir(exist_ok=True)
    weight_map = {}
    for i, key in enumerate(sorted(tensors)):
        name = f"{stem}-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file({key: tensors[key]}, str(directory / name))
        weight_map[key] = name
    (directory / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def _load_into_linear(path) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4))
    load_weights(model, path)
    return model


@pytest.mark.parametrize("sharded", [False, True])
def test_diffusers_checkpoints_are_found_like_transformers_ones(tmp_path, sharded):
    tensors = _tensors(1)
    if sharded:
        _write_sharded(tmp_path / "ckpt", "diffusion_pytorch_model", tensors)
    else:
        (tmp_path / "ckpt").mkdir()
        save_file(tensors, str(tmp_path / "ckpt" / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "ckpt" / "config.json").write_text(
        json.dumps({"_class_name": "Tiny", "_diffusers_version": "0"})
    )
    model = _load_into_linear(tmp_path / "ckpt")
    assert torch.equal(model[0].weight, tensors["0.weight"]) and torch.equal(model[0].bias, tensors["0.bias"])


def test_a_directory_with_two_kinds_of_checkpoint_is_ambiguous(tmp_path):
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    save_file(_tensors(), str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointFileError, match="both a transformers and a diffusers checkpoint"):
        CheckpointFiles(tmp_path)


def test_an_empty_directory_names_what_was_looked_for(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError, match=r"diffusion_pytorch_model\.safetensors.*pickle.*weights\.bin"
    ):
        CheckpointFiles(tmp_path)


def _cut(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p: _cut(p, p.stat().st_size - 5), "is truncated: its header describes"),
        (lambda p: _cut(p, 30), "is truncated: its header needs bytes"),
        (lambda p: _cut(p, 3), "not even the 8-byte header length"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"), "its header is not JSON"),
    ],
    ids=["data", "header", "length", "not-json"],
)
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path, damage, why):
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file))
    damage(file)
    with pytest.raises(CheckpointFileError, match=why) as err:
        _load_into_linear(tmp_path)
    assert str(file) in str(err.value)


def test_a_damaged_shard_of_a_sharded_checkpoint_is_named(tmp_path):
    _write_sharded(tmp_path / "ckpt", "model", _tensors())
    shard = tmp_path / "ckpt" / "model-00002-of-00002.safetensors"
    _cut(shard, shard.stat().st_size - 1)
    with pytest.raises(CheckpointFileError, match="model-00002-of-00002.safetensors is truncated"):
        _load_into_linear(tmp_path / "ckpt")


def _index(tmp_path, edit) -> object:
    _write_sharded(tmp_path / "ckpt", "model", _tensors())
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    edit(index)
    return index


def test_an_index_that_is_not_json_is_named(tmp_path):
    index = _index(tmp_path, lambda p: p.write_text('{"weight_map": {"0.weight": '))
    with pytest.raises(CheckpointFileError, match="is not valid JSON") as err:
        _load_into_linear(tmp_path / "ckpt")
    assert str(index) in str(err.value)


def test_an_index_without_weight_map_is_named(tmp_path):
    index = _index(tmp_path, lambda p: p.write_text(json.dumps({"metadata": {}})))
    with pytest.raises(
        CheckpointFileError, match=r"has no 'weight_map' object .* it holds \['metadata'\]"
    ) as err:
        _load_into_linear(tmp_path / "ckpt")
    assert str(index) in str(err.value)


def test_an_index_naming_a_missing_shard_names_both(tmp_path):
    def edit(p):
        index = json.loads(p.read_text())
        index["weight_map"]["0.bias"] = "model-00009-of-00009.safetensors"
        p.write_text(json.dumps(index))

    index = _index(tmp_path, edit)
    with pytest.raises(
        FileNotFoundError, match=r"do not exist: \['model-00009-of-00009.safetensors'\]"
    ) as err:
        _load_into_linear(tmp_path / "ckpt")
    assert str(index) in str(err.value)


def test_an_index_listing_a_key_its_shard_lacks_names_the_shard(tmp_path):
    def edit(p):
        index = json.loads(p.read_text())
        index["weight_map"]["0.bias"] = index["weight_map"]["0.weight"]
        p.write_text(json.dumps(index))

    _index(tmp_path, edit)
    with pytest.raises(
        CheckpointFileError, match=r"lists \['0.bias'\] in .*model-00002-of-00002.safetensors"
    ):
        _load_into_linear(tmp_path / "ckpt")


def _broadcast_truncated(ctx, path: str) -> str:
    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(CheckpointFileError) as err:
        load_weights(model, path, mode="rank0_broadcast")
    return str(err.value)


def test_rank0_broadcast_reports_a_damaged_file_on_every_rank(dist_pools, tmp_path):
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file))
    _cut(file, file.stat().st_size - 5)
    messages = dist_pools.get(2).run(_broadcast_truncated, str(tmp_path))
    assert all(str(file) in m and "truncated" in m for m in messages)


def test_a_shard_key_the_index_does_not_list_is_still_accounted_for(tmp_path):
    # transformers reads every tensor of every shard the index names, listed or not; a tensor left out of the
    # index must not vanish unreported (here: an unexpected key, so the load fails naming it).
    _write_sharded(tmp_path / "ckpt", "model", _tensors())
    shard = tmp_path / "ckpt" / "model-00001-of-00002.safetensors"
    save_file({**load_file(str(shard)), "0.stale": torch.zeros(2)}, str(shard))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys \(1\): \['0.stale'\]"):
        _load_into_linear(tmp_path / "ckpt")
