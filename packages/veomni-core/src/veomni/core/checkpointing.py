"""Activation checkpointing of blocks: the forward of each matched block recomputed in backward, optionally
keeping the attention kernels' outputs (``keep_attention``: backward then skips the attention forward).

`apply_activation_checkpointing` does it for a model trained without FSDP2; `veomni.core.fsdp.apply_fsdp2` does the
same per block through ``FSDPPolicy.activation_checkpointing``. The block's own ``forward`` is patched, so FQNs and
checkpoint keys do not change.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.hooks import RemovableHandle

from veomni.core.fqn import match_blocks, pattern_tuple
from veomni.core.parallel_state import current_parallel_state_or_none, use_parallel_state

__all__ = ["ATTENTION_OP_NAMES", "COMPILED_MARK", "apply_activation_checkpointing", "is_attention_op"]

# Marks a module whose forward checkpointing replaced with a checkpointed one, so it is never wrapped twice.
_AC_MARK = "_veomni_checkpointed_forward"
# Set by `veomni.core.compile.compile_blocks` on a block whose forward it compiled.
COMPILED_MARK = "_veomni_compiled_forward"


# The attention kernels' forward ops, by qualified name, as the checkpoint's dispatch mode sees them: SDPA's ATen
# backends, the flash op under torch's varlen_attn, veomni's per-segment SDPA of packed CPU rows (the default CPU
# attention of a packed row) and FlashAttention 2/3's custom ops. Names, not op objects: ops outside ATen are
# registered only when their package is imported (veomni.kernels, flash_attn), which may be after this module, and
# core does not import them.
ATTENTION_OP_NAMES = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "torch_attn::_varlen_attn",
        "veomni::sdpa_segments_fwd",
        "flash_attn::_flash_attn_forward",
        "flash_attn::_flash_attn_varlen_forward",
        "flash_attn_3::_flash_attn_forward",
    }
)
"""Ops (default overloads) whose outputs ``keep_attention`` checkpointing saves instead of recomputing."""


@functools.cache
def is_attention_op(op: object) -> bool:
    """Whether ``op`` (an op overload dispatched under checkpointing) is one of `ATTENTION_OP_NAMES`. Cached per op:
    the checkpoint policy asks for every op of every block, in forward and in the recomputation."""
    name = getattr(op, "name", None)
    return callable(name) and name() in ATTENTION_OP_NAMES


class _KeptAttention:
    """What ``keep_attention`` checkpointing of one model's blocks saved: the first forward with gradients must
    keep at least one attention output, or the setting silently does nothing (an attention kernel torch does not
    dispatch as one of `ATTENTION_OP_NAMES`, e.g. FlashAttention 4's own launches, is invisible to the policy)."""

    def __init__(self) -> None:
        self.kept = 0
        self.hook: RemovableHandle | None = None

    def policy(self, ctx: Any, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        """Selective checkpointing's policy: save attention ops' outputs (counted in forward), recompute the rest."""
        if is_attention_op(op):
            self.kept += not ctx.is_recompute
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def watch(self, model: nn.Module) -> None:
        """Check after ``model``'s first forward with gradients that something was kept (then stop checking)."""
        self.hook = model.register_forward_hook(self._check)

    def _check(self, model: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():
            return
        if self.hook is not None:
            self.hook.remove()
        if self.kept == 0:
            kinds = sorted(ATTENTION_OP_NAMES)
            raise ValueError(
                f"activation checkpointing with keep_attention: {type(model).__name__}'s forward ran no attention "
                f"op that checkpointing can save (it saves the outputs of {kinds}), so every block would be "
                "recomputed whole as if keep_attention were off. The attention kernel in use is none of them "
                "(FlashAttention 4's own launches, flex's compiled kernel) or is the eager formula: use an "
                "attention backend whose kernel is (ops.attention sdpa, varlen, flash_attn_2 or flash_attn_3: "
                "veomni.kernels.attention.features.CHECKPOINT_KEEPABLE), or turn parallel.ac_keep_attention off"
            )


def _checkpoint_forward(module: nn.Module, keep_attention: bool = False, tally: _KeptAttention | None = None) -> None:
    if getattr(module, _AC_MARK, False):
        raise ValueError(
            f"activation checkpointing: {type(module).__name__} already has a checkpointed forward"
        )
    if keep_attention and getattr(module, COMPILED_MARK, False):
        # The policy sees the ops dispatched under the checkpoint; a compiled block is one opaque graph there,
        # so nothing would be kept and the setting would silently do nothing.
        raise ValueError(
            f"activation checkpointing with keep_attention: {type(module).__name__}'s forward is compiled, and "
            "a compiled block's attention cannot be selected for saving; turn compilation off (ops.compile: off) "
            "or checkpoint whole blocks (keep_attention off)"
        )
    inner = module.forward
    extra: dict[str, Any] = {}
    if keep_attention:
        if tally is None:
            raise ValueError("keep_attention checkpointing needs the model's _KeptAttention tally")
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, tally.policy)

    # Patching the instance's forward (instead of wrapping the module in another module) keeps every FQN, and
    # with it the checkpoint keys, unchanged. FSDP's hooks run outside it: the unit is gathered before the
    # recomputation and nested expert units gather themselves again during it.
    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is not None and torch.is_grad_enabled():
            # transformers' layers append their keys to the cache; the recomputation would append them again and
            # fail much later with an unrelated error (tensor metadata, or attention reading it as decoding).
            raise ValueError(
                f"activation checkpointing: {type(module).__name__} got a KV cache (past_key_values) while "
                "gradients are on; its recomputation in backward would add the block's keys to the cache a second "
                "time. Call the model with use_cache=False for training"
            )
        # The recomputation runs in backward, outside the caller's `use_parallel_state` block (and on autograd's
        # threads on CUDA): without the state captured here it would skip Ulysses and recompute other shapes.
        state = current_parallel_state_or_none()

        def run(*a: Any, **k: Any) -> Any:
            if state is None:
                return inner(*a, **k)
            with use_parallel_state(state):
                return inner(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    object.__setattr__(module, _AC_MARK, True)


def apply_activation_checkpointing(
    model: nn.Module, block_patterns: tuple[str, ...], *, keep_attention: bool = False
) -> list[str]:
    """Recompute each block's forward in backward, for a model trained without FSDP2 (`apply_fsdp2` does the
    same through ``FSDPPolicy.activation_checkpointing``).

    Args:
        model: the module; its FQNs and checkpoint keys are unchanged (the blocks' ``forward`` is wrapped).
        block_patterns: FQN patterns of the blocks, as in `FSDPPolicy.block_patterns`.
        keep_attention: save the outputs of the attention kernels (`ATTENTION_OP_NAMES`: out ``[B, S, H, D]``-sized
            and its log-sum-exp) and recompute everything else: backward then skips the attention forward, the
            costliest op at long sequences. Eager blocks only (a compiled block is refused). The model's first
            forward with gradients raises ValueError if it kept nothing (an attention kernel that is none of them:
            FlashAttention 4, flex, eager).
    Returns:
        the FQNs of the checkpointed blocks.
    Raises:
        ValueError: a pattern matching nothing, nested blocks, a block already checkpointed, or keep_attention on
            a compiled block.
    """
    blocks = match_blocks(model, pattern_tuple(block_patterns), [], "apply_activation_checkpointing")
    tally = _KeptAttention() if keep_attention else None
    for fqn in blocks:
        _checkpoint_forward(model.get_submodule(fqn), keep_attention, tally)
    if tally is not None:
        tally.watch(model)
    return blocks
