"""The generated Qwen3-VL-MoE adapter against upstream transformers, checkpoints in HF's original (transposed
experts) format through the conversion recipe and back, and its errors.

Oracle: transformers' own ``Qwen3VLMoeForConditionalGeneration`` with the same weights (fp32). With no kernels the
adapter is bitwise upstream, aux loss included; with veomni kernels (encoder varlen tower, grouped-GEMM experts,
load-balancing kernel) it is within fp32 tolerance. The (dp, sp, ep) training grid: tests/train/test_vlm_moe_train.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from loading_fixtures import checkpoint_tensors, eager_ops
from test_qwen3_vl import IMAGE, IMAGES, MIXED, TEXT_ONLY, VOCAB, vlm_batch
from test_qwen3_vl import tiny_config as dense_config
from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as upstream

from veomni.core.ep import apply_expert_plan
from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.loading.diagnosis import dense_moe_diagnosis
from veomni.models.loading.loader import CheckpointMismatchError, WrongModelError
from veomni.models.qwen3_vl_moe.generated import patched_modeling_qwen3_vl_moe as ours
from veomni.models.registry import MODELS

TASK = "image_text_to_text"
EAGER_OPS = dict(rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager", moe_experts="eager",
                 load_balancing_loss="eager")  # fmt: skip
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def tiny_config(**text) -> Qwen3VLMoeConfig:
    """Qwen3-VL's tiny config (2 text layers, 2-block ViT with deepstack) with layer 1 routed: 4 experts, top-2,
    aux loss on; layer 0 dense (``mlp_only_layers``) so both MLP kinds run."""
    values = dense_config().to_dict()
    values["text_config"].update(
        {"moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
         "decoder_sparse_step": 1, "router_aux_loss_coef": 0.05, "output_router_logits": True, **text}
    )  # fmt: skip
    for key in ("model_type", "transformers_version", "architectures"):
        values.pop(key, None)
    values["vision_config"].pop("model_type", None)
    values["text_config"].pop("model_type", None)
    return Qwen3VLMoeConfig(**values)


def build_pair(attn: str = "sdpa", seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config()
    config._attn_implementation = attn
    torch.manual_seed(seed)
    ref = upstream.Qwen3VLMoeForConditionalGeneration(copy.deepcopy(config))
    model = ours.Qwen3VLMoeForConditionalGeneration(config)
    model.load_state_dict(ref.state_dict(), strict=True)
    return ref, model


def run(model: torch.nn.Module, batch: dict) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    logits = None if out.logits is None else out.logits.detach()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits, out.loss.detach(), out.aux_loss.detach(), grads


def test_sub_models_and_config_attributes():
    _, model = build_pair()
    assert type(model.model.visual) is ours.Qwen3VLMoeVisionModel
    assert type(model.model.language_model) is ours.Qwen3VLMoeTextModel
    assert isinstance(model.model.language_model.layers[1].mlp, ours.Qwen3VLMoeTextSparseMoeBlock)
    assert (model.num_experts, model.num_experts_per_tok, model.router_aux_loss_coef) == (4, 2, 0.05)


@pytest.mark.parametrize("rows", [IMAGES, TEXT_ONLY], ids=["images", "text-only"])
def test_no_kernels_is_bitwise_upstream_with_aux_loss(rows):
    ref, model = build_pair()
    batch = vlm_batch(rows)
    want, got = run(ref, batch), run(model, batch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert float(got[2]) > 0
    unequal = [n for n, g in got[3].items() if (g is None) != (want[3][n] is None) or (
        g is not None and not torch.equal(g, want[3][n]))]  # fmt: skip
    assert not unequal, unequal


@pytest.mark.parametrize(
    "ops",
    [
        {"attention": "sdpa", "moe_experts": "torch"},
        pytest.param(
            # The MoE kernels; the dense Triton kernels on this model's shapes: test_qwen3_vl.py, the GPU test below.
            {"attention": "sdpa", "moe_experts": "triton", "load_balancing_loss": "triton"},
            marks=pytest.mark.triton_cpu,
        ),
    ],
    ids=["experts=torch", "experts+lbl=triton"],
)  # fmt: skip
def test_kernels_attached_match_upstream(ops):
    ref, model = build_pair()
    apply_ops(model, OpsConfig(**{**EAGER_OPS, **ops}))
    assert model.config.text_config._experts_implementation == "veomni"
    assert model.model.visual.config._attn_implementation == "veomni_sdpa"
    batch = vlm_batch(MIXED, seed=2)
    want, got = run(ref, batch), run(model, batch)
    if ops.get("cross_entropy", "eager") == "eager":
        torch.testing.assert_close(got[0], want[0], **FP32)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for name, grad in got[3].items():
        torch.testing.assert_close(
            grad, want[3][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_aux_loss_is_weighted_by_text_config_and_reaches_the_router():
    _, model = build_pair()
    batch = vlm_batch(IMAGES, seed=5)
    router = model.model.language_model.layers[1].mlp.gate.weight

    def router_grad(term: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(**batch, **kw)
        value = out.loss if term == "loss" else out.aux_loss
        return value.detach(), torch.autograd.grad(value, router)[0]

    loss, with_aux = router_grad("loss")
    lm_loss, without = router_grad("loss", output_router_logits=False)
    aux, aux_grad = router_grad("aux")
    assert float(aux) > 0 and float(aux_grad.abs().max()) > 0
    torch.testing.assert_close(loss, lm_loss + 0.05 * aux, rtol=0, atol=1e-7)
    torch.testing.assert_close(with_aux, without + 0.05 * aux_grad, rtol=1e-5, atol=1e-8)
    assert model(**batch, output_router_logits=False).aux_loss is None


def test_parallel_plan_shards_only_the_language_models_experts():
    config = tiny_config(num_experts=8)
    with torch.device("meta"):
        model = ours.Qwen3VLMoeForConditionalGeneration(config)
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=4, ep_rank=3)
    assert sorted(shards) == [
        f"model.language_model.layers.1.mlp.experts.{n}" for n in ("down_proj", "gate_up_proj")
    ]
    assert all((s.start, s.stop) == (6, 8) for s in shards.values())
    assert model.model.language_model.layers[1].mlp.experts.gate_up_proj.shape == (2, 48, 64)
    with torch.device("meta"):
        base = ours.Qwen3VLMoeModel(config)
    assert len(apply_expert_plan(base, base.get_parallel_plan(), ep_size=2, ep_rank=0)) == 2


def test_ep_size_that_does_not_divide_the_experts_is_refused():
    with torch.device("meta"):
        model = ours.Qwen3VLMoeForConditionalGeneration(tiny_config())
    with pytest.raises(ValueError, match=r"its 4 experts \(dim 0\) cannot be split evenly across ep_size=3"):
        apply_expert_plan(model, model.get_parallel_plan(), ep_size=3, ep_rank=0)


def test_registry_resolves_the_adapter():
    resolved = MODELS.model_class(tiny_config(), TASK)
    assert resolved.cls is ours.Qwen3VLMoeForConditionalGeneration and resolved.registered
    assert resolved.fast_paths == {"sp", "ep", "fused_kernels"}
    assert MODELS.model_class(tiny_config(), "base").cls is ours.Qwen3VLMoeModel


# ---------------------------------------------------------------- checkpoints


def save_original_format(model: torch.nn.Module, out) -> None:
    """``model`` as the released checkpoints store it: experts transposed (``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``), everything else as ``save_pretrained`` writes it."""
    from safetensors.torch import save_file

    model.save_pretrained(out)
    tensors = {
        k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v)
        for k, v in checkpoint_tensors(str(out)).items()
    }
    for file in list(out.glob("*.safetensors")):
        file.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """HF's original format, as on the Hub (transposed experts)."""
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    torch.manual_seed(3)
    save_original_format(upstream.Qwen3VLMoeForConditionalGeneration(tiny_config()), path)
    return str(path)


def test_original_format_loads_and_exports_back(checkpoint, tmp_path):
    """Original (transposed) experts load through transformers' ``qwen3_vl_moe`` recipe (``Transpose(1, 2)``,
    checked dims) exactly as ``from_pretrained`` loads them; the export has the original's keys and tensors, the
    experts in the model's layout as transformers' own ``save_pretrained`` writes them after that load (its recipe
    is one-way), and it loads back identically in both transformers and veomni."""
    saved = checkpoint_tensors(checkpoint)
    key = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    assert saved[key].shape == (4, 64, 48)
    model = build_model(checkpoint, weights=checkpoint, ops=eager_ops(), task=TASK)
    assert type(model) is ours.Qwen3VLMoeForConditionalGeneration
    assert model.get_parameter(key).shape == (4, 48, 64)
    ref = upstream.Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoint)
    want, got = ref.state_dict(), model.state_dict()
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]

    export_hf(model, tmp_path / "ours")
    ref.save_pretrained(tmp_path / "hf")
    exported, resaved = checkpoint_tensors(str(tmp_path / "ours")), checkpoint_tensors(str(tmp_path / "hf"))
    assert sorted(exported) == sorted(saved) == sorted(resaved)
    assert not [k for k in saved if not torch.equal(exported[k], resaved[k])]
    experts = [k for k in saved if ".mlp.experts." in k]
    assert len(experts) == 2
    assert all(torch.equal(exported[k].transpose(1, 2), saved[k]) for k in experts)
    assert all(torch.equal(exported[k], saved[k]) for k in saved if k not in experts)

    back = build_model(tmp_path / "ours", weights=tmp_path / "ours", ops=eager_ops(), task=TASK).state_dict()
    plain = upstream.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "ours").state_dict()
    assert not [k for k in want if not (torch.equal(back[k], want[k]) and torch.equal(plain[k], want[k]))]


def test_export_generates_in_plain_transformers_like_ours(checkpoint, tmp_path):
    model = build_model(
        checkpoint, weights=checkpoint, ops=OpsConfig(**EAGER_OPS, attention="sdpa"), task=TASK
    )
    export_hf(model, tmp_path / "out")
    plain = upstream.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    batch = vlm_batch([[("image", (1, 4, 4))]], seed=8)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    got, want = model.eval().generate(**inputs, **settings), plain.generate(**inputs, **settings)
    assert want.shape[1] == inputs["input_ids"].shape[1] + 4
    assert torch.equal(got, want)


def test_dense_qwen3_vl_checkpoint_into_the_moe_class_is_a_clear_error(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(dense_config()).save_pretrained(tmp_path)
    # With its config.json: the model types differ.
    with pytest.raises(WrongModelError, match="is a 'qwen3_vl' model.*being loaded is 'qwen3_vl_moe'"):
        build_model(tiny_config(), weights=str(tmp_path), ops=eager_ops(), task=TASK)
    # Weights alone: the keys say it (dense MLP where the model routes experts).
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointMismatchError, match=r"dense MLP .* where the model has MoE experts") as err:
        build_model(tiny_config(), weights=str(tmp_path), ops=eager_ops(), task=TASK)
    assert "model.language_model.layers.1.mlp" in str(err.value)
    assert IMAGE < VOCAB  # the placeholder ids of the shared fixtures fit the tiny vocabulary


def test_dense_moe_diagnosis_both_ways_and_silent_otherwise():
    dense = [f"model.layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    moe = ["model.layers.0.mlp.experts.gate_up_proj (tied with [])", "model.layers.0.mlp.gate.weight"]
    (line,) = dense_moe_diagnosis(moe, dense)
    assert "dense MLP" in line and "['model.layers.0.mlp']" in line
    (line,) = dense_moe_diagnosis(dense, [k.split(" ")[0] for k in moe])
    assert "MoE experts where the model has a dense MLP" in line
    assert dense_moe_diagnosis(dense[:1], ["model.layers.0.mlp.gate_proj.bias"]) == []
    assert dense_moe_diagnosis(moe, ["model.layers.1.mlp.gate_proj.weight"]) == []  # another layer: no claim


@pytest.mark.cuda
def test_gpu_kernels_match_upstream():
    """On a GPU: the Triton kernels (grouped-GEMM experts, RMSNorm, RoPE, SwiGLU, fused cross-entropy, load
    balancing) and the encoder varlen tower against upstream, fp32 with TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref, model = build_pair()
    ref, model = ref.cuda(), model.cuda()
    ops = dict(attention="sdpa", moe_experts="triton", rms_norm="triton", rope="triton", swiglu="triton",
               cross_entropy="triton", load_balancing_loss="triton")  # fmt: skip
    apply_ops(model, OpsConfig(**ops))
    batch = {k: v.cuda() for k, v in vlm_batch(MIXED, seed=2).items()}
    want, got = run(ref, batch), run(model, batch)
    assert got[0] is None  # the fused loss never materialises logits
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for name, grad in got[3].items():
        torch.testing.assert_close(
            grad, want[3][name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
