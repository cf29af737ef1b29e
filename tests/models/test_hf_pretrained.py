"""``from_pretrained`` / ``save_pretrained`` on veomni's generated classes behave as on transformers' own.

For every family with a transformers checkpoint conversion recipe (expert merges, transposes, prefix renames), on
tiny random configs on CPU, what transformers' own model tests check on these paths:

- a checkpoint written by upstream's class (the released, original layout) loads into ours with the conversions
  applied: the same weights and the same logits as upstream's class loading it;
- ours writes the original layout back: the same files as upstream's class writes, which upstream's class loads;
- a checkpoint missing backbone weights is a `CheckpointMismatchError` naming them (transformers would
  initialise them randomly and only log a report), while a missing task head is still allowed;
- greedy generation with a KV cache (sdpa) equals upstream's.

Before `veomni.models.hf.pretrained`, transformers took our classes for custom code and skipped the recipes:
MoE experts stayed random, Qwen2-VL's whole language model stayed random, Qwen3-VL-MoE failed on shapes.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from patchgen.registry import registered_configs
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import tiny_config as deepseek_v3_config
from test_glm4_moe import tiny_config as glm4_moe_config
from test_moe_adapter import tiny_config as qwen3_moe_config
from test_qwen2_5_omni import tiny_config as qwen2_5_omni_config
from test_qwen2_vl import tiny_config as qwen2_vl_config
from test_qwen3_5_vl import tiny_config as qwen3_5_config
from test_qwen3_next import tiny_config as qwen3_next_config
from test_qwen3_omni_moe import tiny_config as qwen3_omni_moe_config
from test_qwen3_vl_moe import tiny_config as qwen3_vl_moe_config
from transformers import PreTrainedModel, Qwen3MoeConfig
from transformers.conversion_mapping import get_model_conversion_mapping

from veomni.models.convert.key_transforms import describe
from veomni.models.hf.pretrained import CheckpointMismatchError

# Plain ids of every tiny vocabulary (the multimodal placeholders are 100 and up).
PROMPT = torch.tensor([[5, 17, 42, 8, 63, 21, 9], [33, 2, 71, 14, 50, 88, 6]])


@dataclass(frozen=True)
class Case:
    """One family: upstream's class writes the checkpoint, ``load`` (upstream's and ours, same name) reads it."""

    family: str
    save: str
    load: str
    config: object

    def upstream(self, name: str) -> type:
        return getattr(
            importlib.import_module(f"transformers.models.{self.family}.modeling_{self.family}"), name
        )

    @property
    def id(self) -> str:
        return self.family if self.save == self.load else f"{self.family}-{self.load}"

    def module(self) -> str:
        return f"veomni.models.{self.family}.generated.patched_modeling_{self.family}"

    def ours(self) -> type:
        return getattr(importlib.import_module(self.module()), self.load)


def _sdpa(config):
    config._attn_implementation = "sdpa"
    return config


CASES = [
    Case("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM", qwen3_moe_config),
    Case("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM", deepseek_v3_config),
    Case("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeForCausalLM", glm4_moe_config),
    Case("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextForCausalLM", qwen3_next_config),
    Case(
        "qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        qwen3_vl_moe_config,
    ),
    Case(
        "qwen2_vl",
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
        lambda: qwen2_vl_config("qwen2_vl"),
    ),
    Case(
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        lambda: qwen2_vl_config("qwen2_5_vl"),
    ),
    Case(
        "qwen2_5_omni",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        qwen2_5_omni_config,
    ),
    Case(
        "qwen3_omni_moe",
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        qwen3_omni_moe_config,
    ),
    # The text model's recipe strips ``model.language_model.``: a released VLM checkpoint loads as a causal LM.
    Case("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", qwen3_5_config),
    Case(
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        lambda: qwen3_5_config(moe=True),
    ),
    # The MoE text model's recipe strips the prefix and merges the per-expert weights.
    Case(
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        lambda: qwen3_5_config(moe=True),
    ),
]


GDN_FUNCTIONS = (
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update",
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def torch_fallback():
    # As in test_qwen3_next: the Gated DeltaNet layers (upstream's and ours) dispatch to flash-linear-attention,
    # CUDA-only, whenever it is installed; these models run on CPU, so they get the torch originals.
    with pytest.MonkeyPatch.context() as patch:
        for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
            for name in (
                f"transformers.models.{family}.modeling_{family}",
                Case(family, "", "", None).module(),
            ):
                module = importlib.import_module(name)
                for fn_name in GDN_FUNCTIONS:
                    fn = getattr(module, fn_name)
                    patch.setattr(module, fn_name, getattr(fn, "__wrapped__", fn))
        yield


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def saved(request, tmp_path_factory, torch_fallback) -> tuple[Case, Path, torch.nn.Module]:
    """The case, the directory upstream's class saved a seeded random model to, and upstream's load of it."""
    case: Case = request.param
    path = tmp_path_factory.mktemp(case.family)
    torch.manual_seed(0)
    case.upstream(case.save)(_sdpa(case.config())).save_pretrained(path)
    reference = case.upstream(case.load).from_pretrained(path)
    return case, path, reference.eval()


def _files(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:4]}"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), use_cache=False).logits


def test_loads_the_upstream_layout_as_upstream_does(saved):
    case, path, reference = saved
    ours = case.ours().from_pretrained(path)
    assert type(ours) is case.ours()
    _assert_same_tensors(ours.state_dict(), reference.state_dict())
    torch.testing.assert_close(_logits(ours), _logits(reference), rtol=0, atol=0)


def test_saves_the_upstream_layout(saved, tmp_path):
    case, path, reference = saved
    ours = case.ours().from_pretrained(path)
    ours.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "upstream")
    _assert_same_tensors(_files(tmp_path / "ours"), _files(tmp_path / "upstream"))
    back = case.upstream(case.load).from_pretrained(tmp_path / "ours")
    _assert_same_tensors(back.state_dict(), reference.state_dict())
    again = case.ours().from_pretrained(tmp_path / "ours")  # and ours reads its own output
    _assert_same_tensors(again.state_dict(), reference.state_dict())


def test_conversion_mapping_is_upstreams(saved):
    case, _, reference = saved
    ours = case.ours()(reference.config)
    want = [describe(t) for t in get_model_conversion_mapping(reference)]
    assert [describe(t) for t in get_model_conversion_mapping(ours)] == want


def test_missing_backbone_weights_are_an_error(saved, tmp_path):
    case, path, _ = saved
    tensors = _files(path)
    dropped = sorted(k for k in tensors if ".layers.0." in k)
    assert dropped
    save_file({k: v for k, v in tensors.items() if k not in dropped}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointMismatchError, match=r"backbone weight.*missing.*layers\.0\.") as err:
        case.ours().from_pretrained(tmp_path)
    assert err.value.missing and all(".layers.0." in k for k in err.value.missing)


def test_greedy_generation_with_a_kv_cache_equals_upstream(saved):
    case, path, reference = saved
    ours = case.ours().from_pretrained(path, attn_implementation="sdpa")
    settings = dict(
        attention_mask=torch.ones_like(PROMPT),
        max_new_tokens=6,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
    want = reference.generate(PROMPT, **settings)
    assert want.shape == (2, PROMPT.shape[1] + 6)
    assert torch.equal(ours.generate(PROMPT, **settings), want)


def test_released_qwen3_vl_moe_expert_layout_is_transposed_on_load(tmp_path):
    # The released Qwen3-VL-MoE checkpoints store the fused experts as [E, H, 2I] / [E, I, H]; transformers' recipe
    # transposes them on load (and its own save_pretrained keeps the model's layout), so write that layout by hand.
    case = next(c for c in CASES if c.family == "qwen3_vl_moe")
    torch.manual_seed(0)
    case.upstream(case.save)(_sdpa(case.config())).save_pretrained(tmp_path / "fused")
    released = {
        k: v.transpose(1, 2).contiguous() if ".experts." in k else v
        for k, v in _files(tmp_path / "fused").items()
    }
    (tmp_path / "released").mkdir()
    save_file(released, tmp_path / "released" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "released" / "config.json").write_text((tmp_path / "fused" / "config.json").read_text())
    reference = case.upstream(case.load).from_pretrained(tmp_path / "released")
    ours = case.ours().from_pretrained(tmp_path / "released")
    _assert_same_tensors(ours.state_dict(), reference.state_dict())
    state = ours.state_dict()
    assert all(torch.equal(state[k], v) for k, v in _files(tmp_path / "fused").items())


def test_tied_embeddings_round_trip(tmp_path):
    # transformers writes one tensor per tied group; the tied head is neither missing nor an error on load.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM as Upstream

    from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Upstream(qwen3_moe_config(tie_word_embeddings=True)).save_pretrained(tmp_path / "upstream")
    assert "lm_head.weight" not in _files(tmp_path / "upstream")
    model, info = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "upstream", output_loading_info=True)
    assert info["missing_keys"] == set()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "ours")
    _assert_same_tensors(_files(tmp_path / "ours"), _files(tmp_path / "upstream"))


def test_a_missing_task_head_still_loads(tmp_path):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM as Upstream

    from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForSequenceClassification

    torch.manual_seed(0)
    source = Upstream(qwen3_moe_config()).eval()
    source.save_pretrained(tmp_path)
    model, info = Qwen3MoeForSequenceClassification.from_pretrained(
        tmp_path, num_labels=3, output_loading_info=True
    )
    assert info["missing_keys"] == {"score.weight"}
    _assert_same_tensors(
        {k: v for k, v in model.state_dict().items() if k.startswith("model.")},
        {k: v for k, v in source.state_dict().items() if k.startswith("model.")},
    )


def test_an_empty_checkpoint_names_the_whole_backbone(tmp_path):
    from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeModel

    config: Qwen3MoeConfig = qwen3_moe_config()
    config.save_pretrained(tmp_path)
    save_file({"unrelated.weight": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointMismatchError, match=r"Qwen3MoeModel\.from_pretrained.*found \d+ missing"
    ) as err:
        Qwen3MoeModel.from_pretrained(tmp_path)
    assert "embed_tokens.weight" in err.value.missing


GENERATED = [
    f"{name.rsplit('.', 1)[0]}.generated.{importlib.import_module(name).config.target_file.removesuffix('.py')}"
    for name in registered_configs()
]


@pytest.mark.parametrize("name", GENERATED, ids=[n.rsplit(".", 1)[1] for n in GENERATED])
def test_no_generated_class_is_custom_code(name):
    module = importlib.import_module(name)
    classes = [
        c
        for c in vars(module).values()
        if inspect.isclass(c) and issubclass(c, PreTrainedModel) and c.__module__ == module.__name__
    ]
    assert classes
    assert [c.__name__ for c in classes if c.is_custom_code()] == []
