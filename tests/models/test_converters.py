"""Checkpoint converters: property tests over random MoE sizes and key orders, lazy regions, recipe selection.

Sizes E, H, I are drawn pairwise distinct (and 2I != H), as in real MoE models, so that shape dispatch is
unambiguous; the ambiguous case is tested on its own.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightRenaming

from veomni.models.convert.converters import (
    BUFFERING,
    ExpertMergeConverter,
    FusedTransposeConverter,
    IncompleteCheckpointError,
    UnsupportedRecipeError,
    apply_converters,
)
from veomni.models.convert.key_transforms import KeyRename
from veomni.models.convert.recipes import UnsupportedTransform, select_converters
from veomni.models.loading.lazy import Concatenated, InMemory, LazyTensor, Stacked, Transposed, full_region

GATE_UP = ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")
DOWN = ("mlp.experts.*.down_proj.weight",)
EXAMPLES = settings(max_examples=40, deadline=None)


@st.composite
def moe_sizes(draw):
    e, h, i = draw(st.integers(1, 6)), draw(st.integers(2, 10)), draw(st.integers(1, 6))
    assume(len({e, h, i, 2 * i}) == 4)
    return e, h, i, draw(st.integers(1, 3))


def qwen_converters(e: int) -> list:
    return [
        ExpertMergeConverter(GATE_UP, "mlp.experts.gate_up_proj", e, 1),
        ExpertMergeConverter(DOWN, "mlp.experts.down_proj", e),
    ]


def split_checkpoint(e: int, h: int, i: int, layers: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ckpt = {}
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        for j in range(e):
            ckpt[f"{p}.{j}.gate_proj.weight"] = torch.randn(i, h, generator=gen)
            ckpt[f"{p}.{j}.up_proj.weight"] = torch.randn(i, h, generator=gen)
            ckpt[f"{p}.{j}.down_proj.weight"] = torch.randn(h, i, generator=gen)
        ckpt[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(e, h, generator=gen)
    ckpt["model.norm.weight"] = torch.randn(h, generator=gen)
    return ckpt


def hf_merge(ckpt: dict, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own ops on the same tensors: the oracle for the merged layout."""
    p = f"model.layers.{layer}.mlp.experts"
    gate = [ckpt[f"{p}.{j}.gate_proj.weight"] for j in range(e)]
    up = [ckpt[f"{p}.{j}.up_proj.weight"] for j in range(e)]
    merged = MergeModulelist(0).convert({"g": gate, "u": up}, ["g", "u"], ["gate_up"])
    gate_up = Concatenate(1).convert(merged, ["g", "u"], ["gate_up"])["gate_up"]
    down = MergeModulelist(0).convert(
        {"d": [ckpt[f"{p}.{j}.down_proj.weight"] for j in range(e)]}, ["d"], ["down"]
    )
    return gate_up, down["down"]


@EXAMPLES
@given(moe_sizes(), st.randoms(use_true_random=False), st.booleans())
def test_split_fused_split_is_identity(sizes, rnd, lazy):
    e, h, i, layers = sizes
    ckpt = split_checkpoint(e, h, i, layers, rnd.randint(0, 10**6))
    items = list(ckpt.items())
    rnd.shuffle(items)
    if lazy:
        items = [(k, InMemory(v)) for k, v in items]
    fused, _ = apply_converters(items, qwen_converters(e))
    assert set(fused) == {k for k in ckpt if ".experts." not in k} | {
        f"model.layers.{n}.mlp.experts.{w}" for n in range(layers) for w in ("gate_up_proj", "down_proj")
    }
    for n in range(layers):
        gate_up, down = (fused[f"model.layers.{n}.mlp.experts.{w}"] for w in ("gate_up_proj", "down_proj"))
        if lazy:
            assert isinstance(gate_up, LazyTensor)
            gate_up, down = gate_up.materialize(), down.materialize()
        assert gate_up.shape == (e, 2 * i, h) and down.shape == (e, h, i)
        want_gate_up, want_down = hf_merge(ckpt, n, e)
        assert torch.equal(gate_up, want_gate_up) and torch.equal(down, want_down)
    # ... and back: the export direction restores every per-expert key bit for bit.
    back = {}
    for key, tensor in fused.items():
        t = tensor.materialize() if isinstance(tensor, LazyTensor) else tensor
        parts = next(
            (c.revert(key, t) for c in qwen_converters(e) if c.revert(key, t) is not None), [(key, t)]
        )
        back.update(parts)
    assert set(back) == set(ckpt)
    assert all(torch.equal(back[k], ckpt[k]) for k in ckpt)


@EXAMPLES
@given(moe_sizes(), st.randoms(use_true_random=False), st.data())
def test_incomplete_experts_raise_naming_them(sizes, rnd, data):
    e, h, i, layers = sizes
    ckpt = split_checkpoint(e, h, i, layers, 0)
    expert_keys = sorted(k for k in ckpt if ".experts." in k)
    dropped = set(data.draw(st.lists(st.sampled_from(expert_keys), min_size=1, unique=True)))
    items = [(k, v) for k, v in ckpt.items() if k not in dropped]
    rnd.shuffle(items)

    def target(key: str) -> str:  # the fused tensor a per-expert key belongs to
        prefix, rest = key.rsplit(".experts.", 1)
        return f"{prefix}.experts." + ("down_proj" if "down_proj" in rest else "gate_up_proj")

    size = {"gate_up_proj": 2 * e, "down_proj": e}
    lost = {target(k) for k in dropped}
    partial = sorted(t for t in lost if sum(target(k) == t for k in dropped) < size[t.rsplit(".", 1)[1]])
    if partial:
        with pytest.raises(IncompleteCheckpointError) as err:
            apply_converters(items, qwen_converters(e))
        assert all(t in str(err.value) for t in partial)
    else:  # whole tensors missing: nothing to merge; the loader's accounting reports them as missing keys
        fused, _ = apply_converters(items, qwen_converters(e))
        assert lost.isdisjoint(fused)


def test_merge_converter_buffers_then_emits_and_refuses_bad_input():
    conv = ExpertMergeConverter(GATE_UP, "mlp.experts.gate_up_proj", 2, 1)
    g0, u0, g1, u1 = (torch.full((3, 4), float(v)) for v in range(4))
    p = "model.layers.0.mlp.experts"
    assert conv.can_handle(f"{p}.0.gate_proj.weight") and not conv.can_handle(f"{p}.gate_up_proj")
    assert not conv.can_handle(f"{p}.0.down_proj.weight")
    assert conv.convert(f"{p}.1.up_proj.weight", u1) is BUFFERING
    assert conv.convert(f"{p}.0.gate_proj.weight", g0) is BUFFERING
    assert conv.convert(f"{p}.1.gate_proj.weight", g1) is BUFFERING
    out = conv.convert(f"{p}.0.up_proj.weight", u0)
    assert out.name == f"{p}.gate_up_proj"
    assert torch.equal(out.tensor, torch.stack([torch.cat([g0, u0]), torch.cat([g1, u1])]))
    conv.finalize()  # nothing left
    with pytest.raises(ValueError, match="out of range"):
        conv.convert(f"{p}.2.gate_proj.weight", g0)
    conv.convert(f"{p}.0.gate_proj.weight", g0)
    with pytest.raises(ValueError, match="arrived twice"):
        conv.convert(f"{p}.0.gate_proj.weight", g0)
    with pytest.raises(ValueError, match="differs from the other experts"):
        conv.convert(f"{p}.1.gate_proj.weight", torch.zeros(5, 4))
    with pytest.raises(IncompleteCheckpointError, match=r"up_proj.weight: missing experts \[0-1\]"):
        conv.finalize()


def test_both_layouts_of_one_layer_is_an_error():
    ckpt = split_checkpoint(2, 5, 3, 1, 0)
    ckpt["model.layers.0.mlp.experts.down_proj"] = torch.zeros(2, 5, 3)
    with pytest.raises(ValueError, match="provides 'model.layers.0.mlp.experts.down_proj' twice"):
        apply_converters(ckpt, qwen_converters(2))


@st.composite
def transposed_case(draw):
    e, h, i, layers = draw(moe_sizes())
    prefixes = [f"model.layers.{n}.mlp.experts" for n in range(layers)]
    ours = {f"{p}.gate_up_proj": (e, 2 * i, h) for p in prefixes} | {
        f"{p}.down_proj": (e, h, i) for p in prefixes
    }
    return ours


@EXAMPLES
@given(transposed_case(), st.randoms(use_true_random=False))
def test_transposing_converter_dispatches_on_shape(ours, rnd):
    conv = FusedTransposeConverter(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ours)
    for key, shape in ours.items():
        assert conv.can_handle(key)
        mine = torch.randn(shape)
        out = conv.convert(key, mine)
        assert out.name == key and out.tensor is mine  # our own layout passes through untouched
        theirs = torch.randn(shape[0], shape[2], shape[1])
        out = conv.convert(key, theirs)
        assert torch.equal(out.tensor, theirs.transpose(1, 2)) and out.tensor.is_contiguous()
        lazy = conv.convert(key, InMemory(theirs)).tensor
        assert isinstance(lazy, LazyTensor) and torch.equal(lazy.materialize(), theirs.transpose(1, 2))
        wrong = list(shape)
        wrong[rnd.randrange(3)] += rnd.randint(1, 3)
        if tuple(wrong) not in (shape, (shape[0], shape[2], shape[1])):
            with pytest.raises(ValueError, match="neither the model's layout"):
                conv.convert(key, torch.zeros(wrong))
    assert not conv.can_handle("model.layers.99.mlp.experts.down_proj")
    conv.finalize()


def test_transposing_converter_refuses_ambiguous_shapes():
    conv = FusedTransposeConverter(["mlp.experts.down_proj"], {"a.mlp.experts.down_proj": (4, 6, 6)})
    with pytest.raises(ValueError, match="cannot be told from its shape"):
        conv.convert("a.mlp.experts.down_proj", torch.zeros(4, 6, 6))
    assert conv.revert("a.mlp.experts.down_proj", torch.zeros(4, 6, 6))[0][1].shape == (4, 6, 6)


@st.composite
def lazy_and_region(draw):
    e, h, i = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    gate = [torch.randn(i, h) for _ in range(e)]
    up = [torch.randn(i, h) for _ in range(e)]
    lazy = Transposed(
        Concatenated([Stacked([InMemory(g) for g in gate]), Stacked([InMemory(u) for u in up])], 1), 1, 2
    )
    eager = torch.cat([torch.stack(gate), torch.stack(up)], 1).transpose(1, 2)
    region = []
    for n in lazy.shape:
        a = draw(st.integers(0, n))
        region.append(slice(a, draw(st.integers(a, n))))
    return lazy, eager, tuple(region)


@EXAMPLES
@given(lazy_and_region())
def test_lazy_regions_equal_slices_of_the_eager_tensor(case):
    lazy, eager, region = case
    assert lazy.shape == tuple(eager.shape)
    assert torch.equal(lazy.read(region), eager[region])
    assert torch.equal(lazy.materialize(), eager)
    assert lazy.read(full_region(lazy.shape)).shape == eager.shape


def test_lazy_regions_are_checked():
    lazy = InMemory(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="not a step-1 range"):
        lazy.read((slice(0, 4), slice(0, 4)))
    with pytest.raises(ValueError, match="has 1 dims"):
        lazy.read((slice(0, 1),))
    with pytest.raises(ValueError, match="different shapes"):
        Stacked([InMemory(torch.zeros(2)), InMemory(torch.zeros(3))])


def _shapes(e=4, h=8, i=3):
    return {
        "model.layers.0.mlp.experts.gate_up_proj": (e, 2 * i, h),
        "model.layers.0.mlp.experts.down_proj": (e, h, i),
        "model.norm.weight": (h,),
    }


def test_selection_follows_the_upstream_recipe_not_the_family_name():
    merge = select_converters(_shapes(), model_type="qwen3_moe", class_name="Qwen3MoeForCausalLM")
    assert [type(c).__name__ for c in merge] == ["ExpertMergeConverter", "ExpertMergeConverter"]
    assert merge[0].sources == GATE_UP and merge[0].num_experts == 4 and merge[0].concat_dim == 1
    # deepseek_v3 is another family with the same (aliased) recipe
    assert [type(c).__name__ for c in select_converters(_shapes(), model_type="deepseek_v3")] == [
        "ExpertMergeConverter",
        "ExpertMergeConverter",
    ]
    (transposing,) = select_converters(_shapes(), model_type="qwen3_vl_moe")
    assert isinstance(transposing, FusedTransposeConverter) and not transposing.transpose_on_export
    assert select_converters(_shapes(), model_type="qwen3") == []
    assert select_converters(_shapes(), model_type="qwen3_5_moe") == []  # fused-direct: no converter


def test_renames_run_before_the_merge_as_in_transformers():
    # mixtral's recipe renames block_sparse_moe -> mlp, then merges w1/w3 and w2: an original checkpoint loads.
    e, h, i = 4, 8, 3
    convs = select_converters(_shapes(e, h, i), model_type="mixtral")
    assert isinstance(convs[0], KeyRename) and "block_sparse_moe" in convs[0].description
    g = torch.Generator().manual_seed(0)
    original = {}
    for x in range(e):
        for w, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            original[f"model.layers.0.block_sparse_moe.experts.{x}.{w}.weight"] = torch.randn(
                shape, generator=g
            )
    out, origin = apply_converters(original, convs)
    gate_up = out["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (e, 2 * i, h)
    assert torch.equal(gate_up[2, :i], original["model.layers.0.block_sparse_moe.experts.2.w1.weight"])
    assert torch.equal(gate_up[2, i:], original["model.layers.0.block_sparse_moe.experts.2.w3.weight"])
    assert "ExpertMergeConverter" in origin["model.layers.0.mlp.experts.down_proj"]
    # ... and a checkpoint already in the model's layout passes untouched.
    ours = {k: torch.zeros(v) for k, v in _shapes(e, h, i).items()}
    assert set(apply_converters(ours, select_converters(_shapes(e, h, i), model_type="mixtral"))[0]) == set(
        ours
    )


def test_transforms_we_do_not_implement_guard_only_the_keys_they_touch():
    # bailing_hybrid concatenates q/k/v conv kernels (a Concatenate without a module-list merge): not ours.
    shapes = {**_shapes(), "model.layers.0.self_attn.conv1d.weight": (6, 1, 4)}
    convs = select_converters(shapes, model_type="bailing_hybrid")
    guards = [c for c in convs if isinstance(c, UnsupportedTransform)]
    assert len(guards) == 1 and "Concatenate" in guards[0].description
    original = {"model.layers.0.self_attn.q_conv1d.weight": torch.zeros(2, 1, 4)}
    with pytest.raises(UnsupportedRecipeError, match="q_conv1d.*bailing_hybrid.*save_original_format=False"):
        apply_converters(original, convs)
    ours = {k: torch.zeros(v) for k, v in shapes.items()}
    out, _ = apply_converters(ours, select_converters(shapes, model_type="bailing_hybrid"))
    assert set(out) == set(ours)


def test_selection_skips_recipes_the_model_has_no_parameter_for():
    assert select_converters({"model.norm.weight": (8,)}, model_type="qwen3_moe") == []


def test_apply_converters_follows_from_pretrained_on_prefixes():
    t = torch.zeros(2)
    model_keys = {"model.layers.0.w", "model.norm.weight", "a.x"}
    # A rename that leads away from the model is dropped when the original key is a model key.
    away = KeyRename(WeightRenaming(r"^a\.", "b."), "test")
    out, origin = apply_converters(
        {"layers.0.w": t, "model.norm.weight": t, "a.x": t},
        [away],
        model_keys=model_keys,
        base_model_prefix="model",
    )
    assert set(out) == model_keys  # `layers.0.w` (a base model's checkpoint) gets the base prefix
    assert origin["model.layers.0.w"] == "layers.0.w"
    # ... and a base model loads from a checkpoint of the model with a head (prefix dropped).
    out, _ = apply_converters(
        {"model.norm.weight": t}, [], model_keys={"norm.weight"}, base_model_prefix="model"
    )
    assert set(out) == {"norm.weight"}
    # Without model_keys nothing is guessed.
    assert set(apply_converters({"layers.0.w": t}, [away])[0]) == {"layers.0.w"}


def test_converter_lists_must_hold_converters_or_key_transforms():
    with pytest.raises(TypeError, match="neither a CheckpointConverter nor a KeyTransform"):
        apply_converters({"x": torch.zeros(1)}, [object()])
