"""``train.cuda_graphs``: shape-stable packing (CPU), the refusals (CPU), and on a GPU the captured steps train
exactly as the eager ones (issue 22 item 3)."""

from __future__ import annotations

import pytest
import torch
from test_loop import DENSE, tiny_recipe
from transformers import Qwen3Config

from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.hf.attention import packed_kwargs
from veomni.train.cuda_graphs import MicroBatchGraphs, document_bucket, static_packing
from veomni.train.loop import build_run
from veomni.train.preflight import PreflightError
from veomni.train.recipe import recipe_from_dict
from veomni.train.step import read_stats, train_step_on_device


def test_document_buckets_are_powers_of_two():
    assert [document_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]
    with pytest.raises(ValueError, match="at least one document"):
        document_bucket(0)


@pytest.mark.parametrize("docs", [(48,), (20, 28), (5, 9, 13, 21), (3, 7, 11, 2, 25)])
def test_static_packing_changes_neither_loss_nor_gradients(docs):
    """Empty documents appended to the segment table and the row length as the longest document give the same
    loss and gradients as the exact table (the CPU attention backends; the GPU test below covers varlen)."""
    config = Qwen3Config(**{k: v for k, v in DENSE.items() if k != "model_type"})
    for attention in ("sdpa", "eager"):
        torch.manual_seed(0)
        eager = dict.fromkeys(("cross_entropy", "rms_norm", "rope", "swiglu"), "eager")  # also on a GPU host
        ops = OpsConfig(attention=attention, compile="off", **eager)
        model = build_model(config, ops=ops, init_device="cpu")
        position_ids = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
        ids = torch.randint(0, DENSE["vocab_size"], (1, position_ids.shape[1]))
        exact = {"input_ids": ids, "position_ids": position_ids, **packed_kwargs(position_ids)}
        exact |= {"labels": ids, "shift_labels": ids}
        padded = static_packing(exact)
        assert padded["cu_seq_lens_q"].numel() == document_bucket(len(docs)) + 1
        assert padded["max_length_q"] == padded["max_length_k"] == ids.shape[1]
        longer = static_packing(exact, row_length=64)  # a short row: one ignored document appended
        assert longer["input_ids"].shape == longer["shift_labels"].shape == (1, 64)
        assert longer["cu_seq_lens_q"].numel() == document_bucket(len(docs) + 1) + 1
        assert longer["max_length_q"] == 64 and (longer["shift_labels"][0, 48:] == -100).all()
        results = []
        for kwargs in (exact, padded, longer):
            model.zero_grad(set_to_none=True)
            loss = model(**kwargs, use_cache=False).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        for loss, grads in results[1:]:
            torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6, msg=attention)
            for a, b in zip(grads, results[0][1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=attention)


def test_refused_off_a_single_gpu(tmp_path):
    raw = tiny_recipe(str(tmp_path), DENSE, steps=1, cuda_graphs=True)
    with pytest.raises(PreflightError, match="train.cuda_graphs=true needs a CUDA device, found cpu"):
        build_run(recipe_from_dict(raw))
    raw["parallel"]["force_fsdp2"] = True
    with pytest.raises(PreflightError, match="found parallel.force_fsdp2=true"):
        build_run(recipe_from_dict(raw))


def _losses(tmp_path, name: str, model_dtype: str, ops: dict, graphs: bool, steps: int = 5):
    raw = tiny_recipe(str(tmp_path / name), DENSE, steps=steps, cuda_graphs=graphs)
    raw["ops"] = ops
    raw["train"]["device"] = "cuda"
    raw["model"]["dtype"] = model_dtype
    run = build_run(recipe_from_dict(raw))
    batches = iter(run.train_data)
    stats = read_stats([train_step_on_device(run, next(batches)) for _ in range(steps)])
    return [s["loss"] for s in stats], [s["grad_norm"] for s in stats], run.graphs


@pytest.mark.cuda
def test_gpu_replays_equal_the_eager_micro_batch_bitwise():
    """The captured graph runs the very kernels of the eager call on the same inputs: loss and every gradient
    bit for bit, on capture and on later replays."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = Qwen3Config(**{k: v for k, v in DENSE.items() if k != "model_type"})
    torch.manual_seed(0)
    model = build_model(config, ops=OpsConfig(attention="sdpa", compile="off"), init_device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in (30, 50, 20)]).unsqueeze(0).cuda()
    ids = torch.randint(0, DENSE["vocab_size"], (1, 100), device="cuda")
    kwargs = static_packing(
        {"input_ids": ids, "position_ids": position_ids, "shift_labels": ids, "labels": ids,
         **packed_kwargs(position_ids)}, row_length=128,
    )  # fmt: skip

    def forward_backward(kw):
        loss = model(**kw, use_cache=False).loss
        loss.backward()
        return loss.detach()

    def grads():
        out = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad.zero_()
        return out

    exact = {"input_ids": ids, "position_ids": position_ids, "shift_labels": ids, "labels": ids,
             **packed_kwargs(position_ids)}  # fmt: skip
    exact_loss = forward_backward(exact).clone()
    exact_grads = grads()
    want_loss = forward_backward(kwargs).clone()
    want_grads = grads()
    # The padding changes nothing on the GPU either (to fp32 rounding: other shapes may block differently).
    torch.testing.assert_close(want_loss, exact_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(want_grads, exact_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    graphs = MicroBatchGraphs(lambda kw: forward_backward(kw), list(model.parameters()))
    for call in range(3):  # eager warm-up, capture (+ replay), replay
        loss = graphs(kwargs).clone()
        got = grads()
        assert torch.equal(loss, want_loss), call
        assert all(torch.equal(a, b) for a, b in zip(got, want_grads, strict=True)), call
    assert (graphs.eager_runs, graphs.captures, graphs.replays) == (1, 1, 2)


# fp32: graphed steps equal eager ones to rounding (padded rows are another shape), with eager and with compiled
# blocks -- the compiled pair also checks that the first run's static-shape graph (the eager run compiles first)
# agrees with the later dynamic one, which inductor's comprehensive padding broke on torch 2.11. The bf16 row runs the
# CUDA defaults (compiled blocks).
@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "ops", "tol"),
    [
        ("float32", {"attention": "sdpa", "compile": "off"}, 1e-5),
        ("float32", {"attention": "sdpa", "compile": "on"}, 1e-5),
        ("bfloat16", {}, 2e-2),
    ],
    ids=["fp32-sdpa", "fp32-sdpa-compiled", "bf16-defaults"],
)
def test_gpu_graphed_steps_train_like_eager_ones(tmp_path, dtype, ops, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager_loss, eager_norm, _ = _losses(tmp_path, "eager", dtype, ops, graphs=False)
    loss, norm, graphs = _losses(tmp_path, "graphs", dtype, ops, graphs=True)
    assert graphs is not None and graphs.captures >= 1 and graphs.replays > graphs.captures, vars(graphs)
    assert loss == pytest.approx(eager_loss, rel=tol) and norm == pytest.approx(eager_norm, rel=tol)
