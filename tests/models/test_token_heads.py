"""The decoder inside every registered ``*ForTokenClassification`` / ``*ForQuestionAnswering`` is the generated
module's patched base model (upstream's generic heads build transformers' own through ``AutoModel``), so kernels and
Ulysses SP reach it; logits, loss and gradients equal upstream's, checkpoints load under upstream's key names, and
under SP the losses of the ranks sum to the single-process loss."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import transformers
from test_seq_cls_decoder import EAGER_OPS, FAMILIES, _config, _generated, torch_fallback  # noqa: F401

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import slice_sequence
from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.heads.token_heads import init_question_answering
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.registry import MODELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = {"token_classification": "ForTokenClassification", "question_answering": "ForQuestionAnswering"}
# transformers has no question-answering head for these (nor does the registry).
NO_QA = ("deepseek_v3", "gpt_oss", "qwen3_5_text")
CASES = [
    (model_type, head)
    for model_type in sorted(FAMILIES)
    # No token heads registered for qwen3_5_text: transformers' Qwen3.5 has none for the text model.
    if model_type != "qwen3_5_text"
    for head in HEADS
    if not (head == "question_answering" and model_type in NO_QA)
]


def _classes(model_type: str, head: str) -> tuple[type, type]:
    prefix = FAMILIES[model_type][1]
    return getattr(_generated(model_type), prefix + HEADS[head]), getattr(transformers, prefix + HEADS[head])


def _pair(model_type: str, head: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    ours_cls, upstream_cls = _classes(model_type, head)
    config = _config(model_type)
    torch.manual_seed(0)
    upstream = upstream_cls(copy.deepcopy(config)).eval()
    with torch.no_grad():  # the hybrids zero-initialise their (1 + w) norms: random ones exercise that path
        for name, p in upstream.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    ours = ours_cls(config).eval()
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream.to(DEVICE), ours.to(DEVICE)


def _inputs(head: str, length: int = 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (2, length), generator=gen)
    if head == "token_classification":
        labels = torch.randint(0, 3, (2, length), generator=gen)
        labels[1, 6:] = -100
        targets = {"labels": labels}
    else:
        targets = {"start_positions": torch.tensor([2, 7]), "end_positions": torch.tensor([4, 9])}
    return {k: v.to(DEVICE) for k, v in {"input_ids": ids, **targets}.items()}


def _outputs(out, head: str) -> torch.Tensor:
    if head == "token_classification":
        return out.logits
    return torch.stack([out.start_logits, out.end_logits], -1)


def _run(model: torch.nn.Module, head: str, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False) if head == "token_classification" else model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return _outputs(out, head).detach(), out.loss.detach(), grads


@pytest.mark.parametrize("model_type, head", CASES)
def test_the_decoder_is_patched_and_the_head_equals_upstream(model_type, head):
    upstream, ours = _pair(model_type, head)
    assert MODELS.model_class(ours.config, head).cls is type(ours)
    base = getattr(_generated(model_type), f"{FAMILIES[model_type][1]}Model")
    prefix = ours.base_model_prefix  # "transformer" for question answering, as upstream
    assert type(getattr(ours, prefix)) is base and type(getattr(upstream, prefix)) is not base
    assert not [m for m in ours.modules() if type(m).__module__.startswith("transformers.models.")]
    assert list(ours.state_dict()) == list(upstream.state_dict())
    inputs = _inputs(head)
    want, got = _run(upstream, head, inputs), _run(ours, head, inputs)
    # No kernels attached: upstream's maths, bit for bit.
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][n], g) for n, g in want[2].items())

    # With kernels (veomni attention, the torch RMSNorm kernel): they reach the decoder, the head still matches.
    kernels = apply_ops(ours, OpsConfig(**{**EAGER_OPS, "rms_norm": "torch"}))
    assert ours.config._attn_implementation == "veomni_sdpa"
    calls: Counter = Counter()

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls["rms_norm"] += 1
            return fn(*args, **kwargs)

        return wrapper

    # Every RMSNorm variant (Qwen3-Next's norms are the (1 + w) ones), per instance: no global patch.
    table = {k: counted(fn) if k[0] == "rms_norm" else fn for k, fn in kernels._table.items()}
    object.__setattr__(kernels, "_table", table)
    got = _run(ours, head, inputs)
    if model_type != "gpt_oss":  # gpt-oss keeps upstream's RMSNorm
        assert calls["rms_norm"] > 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()) + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def test_a_fused_cross_entropy_chosen_for_a_token_head_is_refused():
    _, ours = _pair("qwen3", "token_classification")
    with pytest.raises(ValueError, match="computes its loss upstream's way"):
        apply_ops(ours, OpsConfig(**{**EAGER_OPS, "cross_entropy": "chunk_loss"}))


@pytest.mark.parametrize("head", sorted(HEADS))
def test_upstream_checkpoints_load_by_build_model(tmp_path, head):
    upstream, _ = _pair("qwen3", head)
    upstream.cpu().save_pretrained(tmp_path)
    model = build_model(str(tmp_path), weights=str(tmp_path), ops=OpsConfig(**EAGER_OPS), task=head).eval()
    ours_cls, _ = _classes("qwen3", head)
    assert type(model) is ours_cls
    assert type(getattr(model, model.base_model_prefix)) is _generated("qwen3").Qwen3Model
    inputs = {k: v.cpu() for k, v in _inputs(head).items()}
    with torch.no_grad():
        want = _outputs(upstream.cpu()(**inputs), head)
        torch.testing.assert_close(_outputs(model(**inputs), head), want, rtol=1e-5, atol=1e-5)


def test_init_question_answering_refuses_a_mismatched_config_or_class():
    module = _generated("qwen3")
    with pytest.raises(TypeError, match="the base model Qwen3Model takes a Qwen3Config, got LlamaConfig"):
        module.Qwen3ForQuestionAnswering(_config("llama"))
    with pytest.raises(TypeError, match="expected a GenericForQuestionAnswering subclass, got Qwen3Model"):
        init_question_answering(module.Qwen3Model(_config("qwen3")), _config("qwen3"), module.Qwen3Model)


def _sp_case(ctx, head: str, length: int) -> dict:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    _, ours = _pair("qwen3", head)
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    inputs = {k: v.cpu() for k, v in _inputs(head, length).items()}
    positions = torch.arange(length)[None].expand(2, -1)
    ref = _run(ours, head, {**inputs, "position_ids": positions})
    local = {
        "input_ids": slice_sequence(inputs["input_ids"], 1, group),
        "position_ids": slice_sequence(positions, 1, group),
        "sp_unpadded_len": length,
    }
    if head == "token_classification":
        local["labels"] = slice_sequence(inputs["labels"], 1, group, pad_value=-100)
    else:
        local.update(start_positions=inputs["start_positions"], end_positions=inputs["end_positions"])
    with use_parallel_state(state):
        out, loss, grads = _run(ours, head, local)
    total = loss.clone()
    dist.all_reduce(total, group=group)
    worst, worst_name = 0.0, ""
    for name, grad in ref[2].items():
        summed = grads[name].clone()
        dist.all_reduce(summed, group=group)
        # A span head's bias gets no gradient (a softmax over positions is shift-invariant): floor the scale.
        rel = float((summed - grad).abs().max() / grad.abs().max().clamp(min=1e-3))
        worst, worst_name = max((worst, worst_name), (rel, name))
    want_out = ref[0] if head == "question_answering" else slice_sequence(ref[0], 1, group)
    return {
        "out": float((out - want_out).abs().max()),
        "loss": abs(float(total - ref[1])),
        "grad_rel": worst,
        "worst": worst_name,
    }


@pytest.mark.parametrize("head, length", [("token_classification", 10), ("question_answering", 9)])
def test_ulysses_sp_losses_sum_to_the_single_process_loss(dist_pools, head, length):
    # 9 tokens: the shards are padded to 10 (sp_unpadded_len cuts the padding from the span logits).
    for result in dist_pools.get(2).run(_sp_case, head, length):
        assert result["out"] < 1e-5 and result["loss"] < 1e-5 and result["grad_rel"] < 1e-4, result
