"""Mixed precision without FSDP2: a plain module computing in bf16 over fp32 master weights the optimizer owns.

On one rank FSDP2 has nothing to shard, yet with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` it
still re-casts every block's parameters and runs its per-block hooks in every forward and backward (Qwen3-1.7B on
one H100: half the throughput of the same module in pure bf16, notebook/benchmarks-log.md). `apply_master_weights` gives
the same arithmetic with one cast per optimizer step:

- the module's floating parameters become bf16 (``compute_dtype``) tensors, each the rounding of its fp32 master;
- the fp32 masters (the original fp32 storage, no copy) are the parameters of `MasterWeights.module`, a mirror of
  the model's module tree with the same FQNs and the model's own buffers: optimizer, clipping and DCP
  checkpoints work on it exactly as on the FSDP2 model (same names, same global shapes, fp32 values);
- each bf16 gradient is added into its master's fp32 ``grad`` as soon as autograd has accumulated it
  (``register_post_accumulate_grad_hook``) and then dropped, so bf16 gradients are transient and micro-batches
  accumulate in fp32 -- what FSDP2's fp32 ``reduce_dtype`` does on one rank;
- floating forward inputs of the root and of each block are cast to ``compute_dtype``, as each FSDP2 unit does
  (``cast_forward_inputs``), so floating inputs round alike on both paths (the trainer passes
  ``num_items_in_batch`` as an int64 count, which neither casts);
- after the optimizer step `MasterWeights.push` copies the masters into the bf16 parameters (one foreach copy).

Losses, gradient norms, weights and AdamW state then equal FSDP2 mixed precision's bit for bit on CPU
(tests/train/test_master_weights.py, dense and MoE, gradient accumulation, lr multipliers, a frozen module).

It lives in core because it is a precision/parallelism primitive beside `veomni.core.fsdp.apply_fsdp2` (torch
only, no trainer state): any loop that steps an optimizer over ``masters.module`` and calls ``push`` uses it.

Memory per parameter: 2 (bf16) + 4 (master) + 4 (fp32 grad) + 8 (AdamW) = 18 bytes, against FSDP2's 16 on one rank
(which frees all but the root's bf16 copies between uses): the price of not re-casting every forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils import _pytree as pytree

from veomni.core.fqn import fqn_matches

__all__ = ["MasterWeights", "apply_master_weights", "master_weights_of"]

_ATTR = "_veomni_master_weights"


@attrs.define(eq=False)
class MasterWeights:
    """The handle `apply_master_weights` returns (also reachable through `master_weights_of(model)`).

    Attributes:
        module: the fp32 mirror of the model: same FQNs, the masters as its parameters (``requires_grad`` as in the
            model), the model's buffers shared. Give it to the optimizer, `veomni.core.clip.clip_grad_norm` and
            checkpoints; never run it (it has no forward).
        compute_dtype: the dtype the model's parameters hold and compute in.
        params: the model's compute parameters, one per master, in ``masters`` order.
        masters: the fp32 masters.
        trainable: indices into ``params``/``masters`` of the trained (``requires_grad``) ones.
    """

    module: nn.Module
    compute_dtype: torch.dtype
    params: list[nn.Parameter]
    masters: list[nn.Parameter]
    trainable: list[int]
    _hooks: list[Any] = attrs.field(factory=list, repr=False)

    @torch.no_grad()
    def push(self, *, trainable_only: bool = True) -> None:
        """Copy the masters into the compute parameters (round to nearest, as FSDP2's cast), one foreach copy.

        Call after every optimizer step (trained ones only: frozen masters never change) and with
        ``trainable_only=False`` after loading a checkpoint into `module`.
        """
        index = self.trainable if trainable_only else range(len(self.params))
        if index:
            torch._foreach_copy_([self.params[i] for i in index], [self.masters[i] for i in index])

    @contextlib.contextmanager
    def exposed(self) -> Iterator[None]:
        """Within the block the model's parameters show the fp32 masters (same tensors, no copy), so that code
        reading the model -- an HF export -- writes the master values; the compute tensors come back after.
        Nothing may run forward or step inside it."""
        saved = [p.data for p in self.params]
        try:
            for p, m in zip(self.params, self.masters, strict=True):
                p.data = m.data
            yield
        finally:
            for p, data in zip(self.params, saved, strict=True):
                p.data = data


def master_weights_of(model: nn.Module) -> MasterWeights | None:
    """The `MasterWeights` `apply_master_weights` attached to ``model``, or None."""
    return getattr(model, _ATTR, None)


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # FSDP2's cast_forward_inputs: every floating tensor of any dtype other than the compute dtype.
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)


def _accumulate(master: nn.Parameter, param: nn.Parameter) -> None:
    # After autograd accumulated this backward's bf16 gradient: fold it into the fp32 one and free it. The first
    # micro-batch's is converted (exact), later ones added in fp32: FSDP2's fp32 reduce + accumulate on one rank.
    grad = param.grad
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)
    param.grad = None


def _mirror(module: nn.Module, masters: dict[int, nn.Parameter], memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:  # a submodule registered twice stays one module
        return memo[id(module)]
    out = nn.Module()
    memo[id(module)] = out
    for name, p in module._parameters.items():
        out.register_parameter(name, None if p is None else masters.get(id(p), p))
    for name, b in module._buffers.items():
        out.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        out.add_module(name, None if child is None else _mirror(child, masters, memo))
    return out


def apply_master_weights(
    model: nn.Module,
    compute_dtype: torch.dtype,
    block_patterns: Sequence[str] = (),
    *,
    cast_inputs: bool = True,
) -> MasterWeights:
    """Turn ``model`` (fp32, not FSDP-wrapped) into a ``compute_dtype`` module trained over fp32 masters, in place.

    Args:
        model: a materialised module whose floating parameters are all fp32 (on any one device).
        compute_dtype: a floating dtype below fp32 (bf16, fp16): the parameters' dtype from now on.
        block_patterns: FQN globs of the blocks whose floating forward inputs are cast, as FSDP2's units (the
            root always is); `veomni.core.FSDPPolicy.block_patterns`.
        cast_inputs: False casts no forward input, as FSDP2 with ``FSDPPolicy.cast_forward_inputs=False`` (models
            taking float32 inputs on purpose, such as diffusers' DiTs' timesteps).
    Returns:
        the `MasterWeights`; step an optimizer over its ``module`` and call its ``push`` after each step.
    Raises:
        ValueError: an FSDP-wrapped model, parameters not fp32, a compute dtype not below fp32, a pattern matching
            nothing, or a model whose state-dict keys the mirror cannot reproduce (state-dict hooks).
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise ValueError(
            "apply_master_weights: the model is FSDP-wrapped; FSDP2 mixed precision already applies"
        )
    if master_weights_of(model) is not None:
        raise ValueError("apply_master_weights: the model already has master weights")
    if not (compute_dtype.is_floating_point and torch.finfo(compute_dtype).bits < 32):
        raise ValueError(
            f"apply_master_weights: compute_dtype must be a float below fp32, got {compute_dtype}"
        )
    named = list(model.named_parameters())  # tied parameters once
    bad = [f"{n} ({p.dtype})" for n, p in named if p.is_floating_point() and p.dtype != torch.float32]
    if bad:
        raise ValueError(
            f"apply_master_weights: fp32 parameters expected (they become the masters); {len(bad)} are not: "
            f"{', '.join(bad[:6])}"
        )
    blocks = [
        fqn for fqn, _ in model.named_modules() if fqn and any(fqn_matches(p, fqn) for p in block_patterns)
    ]
    if missing := [p for p in block_patterns if not any(fqn_matches(p, fqn) for fqn in blocks)]:
        raise ValueError(f"apply_master_weights: block pattern(s) {missing} matched no module of the model")

    params: list[nn.Parameter] = []
    masters: list[nn.Parameter] = []
    trainable: list[int] = []
    by_id: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for _, p in named:
            if not p.is_floating_point():
                continue
            # The master keeps the fp32 storage; the model's parameter (same object: ties, hooks and references
            # stay valid) gets a rounded copy.
            master = nn.Parameter(p.data, requires_grad=p.requires_grad)
            p.data = p.data.to(compute_dtype)
            if p.requires_grad:
                trainable.append(len(params))
                # torch's Tensor.register_post_accumulate_grad_hook carries no annotations.
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(_accumulate, master)
                )
            params.append(p)
            masters.append(master)
            by_id[id(p)] = master
    mirror = _mirror(model, by_id, {})
    want, got = list(model.state_dict(keep_vars=True)), list(mirror.state_dict(keep_vars=True))
    if want != got:
        only_model, only_mirror = sorted(set(want) - set(got))[:6], sorted(set(got) - set(want))[:6]
        raise ValueError(
            "apply_master_weights: the fp32 mirror's state-dict keys differ from the model's (state-dict "
            f"hooks?): only in the model {only_model}, only in the mirror {only_mirror}"
        )
    hooks = [
        module.register_forward_pre_hook(functools.partial(_cast_inputs, compute_dtype), with_kwargs=True)
        for module in ([model, *(model.get_submodule(b) for b in blocks)] if cast_inputs else [])
    ]
    handle = MasterWeights(mirror, compute_dtype, params, masters, trainable, hooks)
    object.__setattr__(model, _ATTR, handle)
    return handle
