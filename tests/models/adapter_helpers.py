"""What the adapter tests share: an upstream/ours pair holding the same weights, a packed row of documents, one
forward and backward's results, the fp32 router bias of a bf16 build, and Ulysses SP against one process (the conformance suite, the dense adapters, and
the DeepSeek-V3, GLM-4.5 MoE, Qwen3-MoE and Qwen3-Next modules)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist

from veomni.core.parallel_state import ParallelState, use_parallel_state
from veomni.core.sp import gather_sequence, slice_sequence
from veomni.kernels import OpsConfig
from veomni.models.build import build_model

# On a GPU runner the adapter tests run on CUDA (Triton compiled); on CPU, Triton runs through its interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def upstream_pair(
    upstream_class: type,
    ours_class: type,
    config,
    *,
    perturb: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' ``upstream_class`` and our ``ours_class`` on ``config``, both on `DEVICE`, ours holding
    upstream's weights (loaded strictly). Upstream is seeded and built on a copy of ``config`` (``apply_ops`` edits
    the config it is given); ``perturb(upstream)`` redraws what upstream initialises to constants before the copy."""
    torch.manual_seed(0)
    upstream = upstream_class(copy.deepcopy(config))
    if perturb is not None:
        perturb(upstream)
    upstream.to(DEVICE)
    ours = ours_class(config).to(DEVICE)
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream, ours


def packed_batch(lengths: tuple[int, ...] = (5, 8, 4), seed: int = 1) -> dict[str, torch.Tensor]:
    """One packed row of documents on `DEVICE`: int64 ``input_ids``, ``position_ids`` (restarting per document) and
    ``labels``, each ``[1, sum(lengths)]``; each document's first token is unlabelled, so no target crosses."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor((0, *lengths[:-1])), 0)] = -100
    return {"input_ids": ids.to(DEVICE), "position_ids": positions.to(DEVICE), "labels": labels.to(DEVICE)}


def run(
    model: torch.nn.Module, inputs: dict, **extra
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[B, S, V]`` (None when a fused loss never makes them), loss and every parameter's gradient of one
    forward and backward. No cache: HF then reads the packing from ``position_ids``."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (None if out.logits is None else out.logits.detach()), out.loss.detach(), grads


def grad_norm(grads: dict[str, torch.Tensor]) -> float:
    """The global L2 norm of ``grads`` (`run`'s third result)."""
    return float(torch.cat([g.flatten() for g in grads.values()]).norm())


def assert_router_bias_is_an_fp32_buffer(config, ops: OpsConfig) -> None:
    """A bf16 build of ``config`` (a DeepSeek-V3-style router in layer 1, ``ops`` its kernels) keeps the router's
    ``e_score_correction_bias`` an fp32 buffer, not a parameter, as ``from_pretrained`` keeps it (a bf16 bias would
    change which experts win close calls)."""
    model = build_model(config, ops=ops, dtype=torch.bfloat16)
    router = model.model.layers[1].mlp.gate
    assert "e_score_correction_bias" in dict(router.named_buffers())
    assert "e_score_correction_bias" not in dict(model.named_parameters())
    assert router.e_score_correction_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16


def summed_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``[B, S, V]`` logits against pre-shifted ``[B, S]`` targets (-100 ignored), summed."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def sp_against_one_process(
    model: torch.nn.Module, state: ParallelState, ids: torch.Tensor, positions: torch.Tensor,
    labels: torch.Tensor, *, whole: dict, sharded: dict,
) -> dict[str, float]:  # fmt: skip
    """``model`` on the whole row (``whole``: its extra kwargs), then on this rank's slices under ``state``'s SP
    group (``sharded``), each backward of the summed CE against the pre-shifted ``labels`` ``[B, S]``.

    Returns:
        ``logits``: the largest error of the gathered logits; ``grad``: the worst gradient error (summed over the
        ranks) in units of its tolerance (1e-5 of the reference's largest entry + 1e-6); ``missing``: parameters
        the sharded pass left without a gradient.
    """
    group = state.sp_group
    ref = model(input_ids=ids, position_ids=positions, **whole).logits
    summed_ce(ref, labels).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with use_parallel_state(state):
        local = model(input_ids=slice_sequence(ids, 1, group), position_ids=slice_sequence(positions, 1, group),
                      **sharded).logits  # fmt: skip
    summed_ce(local, slice_sequence(labels, 1, group, pad_value=-100)).backward()
    full = gather_sequence(local.detach(), group, dim=1, equal_sizes=True)[:, : ids.shape[1]]
    worst = {"logits": (full - ref.detach()).abs().max().item(), "grad": 0.0, "missing": 0}
    for name, p in model.named_parameters():
        if p.grad is None:
            worst["missing"] += 1
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank holds its tokens' share of the gradient
        tol = 1e-5 * ref_grads[name].abs().max() + 1e-6
        worst["grad"] = max(worst["grad"], ((grad - ref_grads[name]).abs().max() / tol).item())
    return worst
