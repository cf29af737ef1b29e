"""Key renames from transformers' recipes: hypothesis round trips, and parity with transformers' own walk.

Keys are drawn from a vocabulary of whole components (as real state-dict keys are), so a recipe pattern
anchored on a component boundary sees realistic input. The oracle is transformers itself:
``get_model_conversion_mapping`` for the walk, ``rename_source_key`` for load-time names and
``revert_weight_conversion`` (what ``save_pretrained`` writes) for export-time names.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key, revert_weight_conversion

from veomni.models.convert.converters import apply_converters, split_transforms
from veomni.models.convert.key_transforms import (
    KeyRename,
    ScopedConverter,
    rename_key,
    scope_prefixes,
    unrename_key,
)
from veomni.models.convert.recipes import recipe_transforms
from veomni.models.export.hf import _leaders, plan_layout
from veomni.models.loading import converters_for, model_targets

EXAMPLES = settings(max_examples=150, deadline=None)

VOCAB = (
    "layers", "0", "1", "17", "mlp", "self_attn", "q_proj", "blocks", "merger", "attn", "qkv", "norm",
    "embed_tokens", "patch_embed", "proj", "model", "visual", "language_model", "audio_tower", "thinker",
    "experts", "gate_proj",
)  # fmt: skip


@st.composite
def keys(draw, tops: tuple[str, ...], banned_second: tuple[str, ...] = ()) -> str:
    """``top.second.[...].leaf`` with components from `VOCAB`."""
    top = draw(st.sampled_from(tops))
    second = draw(st.sampled_from([v for v in VOCAB if v not in banned_second]))
    rest = draw(st.lists(st.sampled_from(VOCAB), max_size=4))
    leaf = draw(st.sampled_from(("weight", "bias")))
    return ".".join((top, second, *rest, leaf))


def _transform(recipe: str, index: int, scope: str | None = None) -> object:
    t = get_checkpoint_conversion_mapping(recipe)[index]
    if scope is not None:
        t.scope_prefix, t.base_model_prefix = scope, "model"
    return t


# One transform of each kind we support: regex renames with a negative look-ahead (Qwen2-VL), look-behinds
# (T5Gemma2), a capture group that drops a prefix (SAM3 tracker), PrefixChange adding / removing a prefix
# (with and without a model prefix), and scoped copies (a sub-model's recipe). The last field excludes keys
# on which transformers' own transform is not invertible: removing prefix P from ``P.P.x`` gives ``P.x``,
# which the inverse (add P unless already there) leaves alone. No real checkpoint repeats its prefix.
TRANSFORMS = {
    "lookahead": (lambda: _transform("Qwen2VLForConditionalGeneration", 1), ("model", "visual", "lm_head"), None),
    "anchored": (lambda: _transform("Qwen2VLForConditionalGeneration", 0), ("visual", "model"), None),
    "lookbehind": (lambda: _transform("t5gemma2_encoder", 2), ("layers", "encoder", "decoder", "text_model"), None),
    "capture_group": (lambda: _transform("sam3_tracker", 2), ("tracker_model", "other"), None),
    "prefix_add": (lambda: _transform("Qwen2VLModel", 0), ("model", "visual"), None),
    "prefix_remove": (
        lambda: _transform("Qwen2_5OmniThinkerForConditionalGeneration", 0), ("thinker", "model"),
        r"^thinker\.thinker\.",
    ),
    "prefix_remove_model": (
        lambda: _transform("qwen3_5_text", 0), ("model",), r"^model\.language_model\.language_model\.",
    ),
    "scoped_prefix_remove": (
        lambda: _transform("qwen3_5_text", 0, scope="language_model"), ("model", "language_model"),
        r"language_model\.language_model\.",
    ),
    "scoped_prefix_add": (lambda: _transform("Qwen2VLModel", 0, scope=""), ("model", "visual"), None),
    "scoped_lookahead": (
        lambda: _transform("Qwen2VLForConditionalGeneration", 1, scope="thinker"), ("model", "thinker"), None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(TRANSFORMS))
def test_every_rename_kind_is_undone_by_its_inverse(kind):
    make, tops, excluded = TRANSFORMS[kind]
    rename = KeyRename(make(), "test")
    domain = keys(tops) if excluded is None else keys(tops).filter(lambda k: not re.search(excluded, k))

    @EXAMPLES
    @given(st.sets(domain, min_size=1, max_size=24))
    def check(key_set):
        applied = {k: rename.apply(k) for k in key_set}
        fired = {k for k, a in applied.items() if a != k}
        # revert(apply(keys)) == keys for every key the transform renames ...
        assert {k: rename.revert(applied[k]) for k in fired} == {k: k for k in fired}
        # ... and exactly as transformers renames it.
        oracle = make()
        assert applied == {k: oracle.rename_source_key(k)[0] for k in key_set}

    check()


def test_some_keys_fire_for_each_kind():
    # Guards the property test above against vacuous generators: each kind renames some vocabulary key.
    samples = {
        "lookahead": "model.layers.0.weight",
        "anchored": "visual.blocks.0.weight",
        "lookbehind": "layers.0.norm.weight",
        "capture_group": "tracker_model.mlp.weight",
        "prefix_add": "model.model.layers.weight",
        "prefix_remove": "thinker.model.norm.weight",
        "prefix_remove_model": "model.language_model.norm.weight",
        "scoped_prefix_remove": "model.language_model.model.language_model.norm.weight",
        "scoped_prefix_add": "model.model.norm.weight",
        "scoped_lookahead": "model.thinker.model.norm.weight",
    }
    assert set(samples) == set(TRANSFORMS)
    for kind, key in samples.items():
        rename = KeyRename(TRANSFORMS[kind][0](), "test")
        assert rename.apply(key) != key, kind
        assert rename.revert(rename.apply(key)) == key, kind
    # The excluded keys: transformers' transform itself loses the repeated prefix, and so do we.
    remove = TRANSFORMS["prefix_remove"][0]
    assert (
        KeyRename(remove(), "test").apply("thinker.thinker.x")
        == remove().rename_source_key("thinker.thinker.x")[0]
    )


def _recipe_renames(recipe: str) -> list[KeyRename]:
    return [KeyRename(t, recipe) for t in get_checkpoint_conversion_mapping(recipe)]


@EXAMPLES
@given(
    st.sets(keys(("model", "visual", "lm_head"), banned_second=("language_model", "visual")), max_size=30),
    st.sets(
        keys(("model", "visual", "audio_tower", "lm_head"), ("language_model", "visual", "audio_tower")).map(
            lambda k: "thinker." + k  # the Omni checkpoints hold the thinker under `thinker.`
        ),
        max_size=30,
    ),
)
def test_whole_recipes_round_trip_on_original_layout_key_sets(qwen2_vl_keys, omni_keys):
    # Original-layout checkpoints (no `model.language_model.` / `model.visual.` yet): load then export is the
    # identity on the whole key set, and no two keys collide on load.
    for recipe, key_set in (
        ("Qwen2VLForConditionalGeneration", qwen2_vl_keys),
        ("Qwen2_5OmniThinkerForConditionalGeneration", omni_keys),
    ):
        renames = _recipe_renames(recipe)
        loaded = [rename_key(k, renames) for k in key_set]
        assert len(set(loaded)) == len(key_set)
        assert {unrename_key(k, renames) for k in loaded} == key_set


def test_scopes_follow_transformers_prefix_rule():
    assert scope_prefixes(None, "model") is None
    assert scope_prefixes("language_model", "model") == ("model.language_model.", "language_model.")
    assert scope_prefixes("", "model") == ("model.", "")
    assert scope_prefixes("visual", "") == ("visual.",)


def test_a_rename_without_inverse_fails_only_on_export():
    class OneWay(WeightRenaming):
        __slots__ = ()

        def reverse_transform(self):
            raise ValueError("lossy")

    rename = KeyRename(OneWay(r"^old\.", "new."), "custom")
    assert rename.apply("old.x.weight") == "new.x.weight"
    with pytest.raises(Exception, match=r"no inverse \(ValueError: lossy\).*'new.x.weight'"):
        rename.revert("new.x.weight")


# Composite classes whose checkpoints need sub-model recipes; built on meta from their default configs.
COMPOSITES = (
    ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig"),
    ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
    ("Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniThinkerConfig"),
    ("Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerConfig"),
    ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig"),
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
)


@pytest.fixture(scope="module", params=[c[0] for c in COMPOSITES])
def meta_composite(request):
    config = getattr(transformers, dict(COMPOSITES)[request.param])()
    with torch.device("meta"):
        return getattr(transformers, request.param)(config)


def _signature(t: object) -> tuple:
    return (repr(t), t.scope_prefix, t.base_model_prefix)


def test_the_walk_is_transformers_walk(meta_composite):
    ours = [_signature(t) for _, t in recipe_transforms(meta_composite)]
    assert ours == [_signature(t) for t in get_model_conversion_mapping(meta_composite)]
    assert any(t[1] is not None for t in ours) or type(meta_composite).__name__ == "Qwen3_5MoeForCausalLM"


def test_export_layout_is_save_pretrained_layout_and_loads_back(meta_composite):
    model = meta_composite
    targets = model_targets(model)
    leaders = _leaders(model, targets)
    state = {k: v for k, v in model.state_dict().items() if k in leaders}
    # What save_pretrained writes for a model it did not load (our case: built, then trained).
    hf = revert_weight_conversion(model, dict(state))
    shapes = {k: (targets[k].full_shape, targets[k].tensor.dtype) for k in leaders}
    items = plan_layout(shapes, converters_for(model, targets, for_export=True))
    ours = {name: shape for item in items for name, shape, _ in item.parts}
    assert ours == {k: tuple(v.shape) for k, v in hf.items()}
    # Loading that layout gives back every model key with its shape (meta tensors: no data).
    convs = converters_for(model, targets)
    loaded, _ = apply_converters(
        {k: torch.empty(s, device="meta") for k, s in ours.items()},
        convs,
        model_keys=targets,
        base_model_prefix=model.base_model_prefix,
    )
    assert {k: tuple(v.shape) for k, v in loaded.items()} == {k: shapes[k][0] for k in leaders}
    renames, _ = split_transforms(convs)
    oracle = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    for key in list(ours)[:: max(1, len(ours) // 200)]:  # load-time names equal transformers' own
        assert rename_key(key, renames) == rename_source_key(key, oracle, [])[0]


def test_scoped_converters_claim_only_their_sub_model():
    model_cls, config_cls = COMPOSITES[4]
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)())
    convs = converters_for(model)
    scoped = [c for c in convs if isinstance(c, ScopedConverter)]
    assert {c.scope for c in scoped} == {"language_model"} and len(scoped) == 2
    merge = scoped[0]
    assert merge.can_handle("model.language_model.layers.0.mlp.experts.3.gate_proj.weight")
    assert merge.can_handle("language_model.layers.0.mlp.experts.3.gate_proj.weight")  # base model checkpoint
    assert not merge.can_handle("model.visual.blocks.0.mlp.experts.3.gate_proj.weight")
    fused = torch.empty(merge.num_experts, 4, 2, device="meta")
    assert merge.revert("model.visual.blocks.0.mlp.experts.gate_up_proj", fused) is None
    assert (
        len(merge.revert("model.language_model.layers.0.mlp.experts.gate_up_proj", fused))
        == 2 * merge.num_experts
    )
