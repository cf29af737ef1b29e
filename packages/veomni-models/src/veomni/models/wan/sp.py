"""Ulysses sequence parallelism for diffusers' ``WanTransformer3DModel`` (Wan2.1 T2V / I2V), switched on by
`apply_dit_sp`.

diffusers' forward runs unchanged; four hooks and one attention processor make it sequence-parallel over the
SP group of ``P`` ranks (every rank of the group is fed the *same* full sample):

- ``rope`` output: the rotary ``cos``/``sin`` ``[1, S, 1, D]`` are padded to a multiple of ``P`` and cut to
  this rank's ``[1, ceil(S/P), 1, D]``;
- ``blocks[0]`` input: the patchified tokens ``[B, S, C]`` are padded and cut the same way;
- every ``attn1`` (self-attention): local Q/K/V, rotary on the local rows, then `ulysses_attention` (all-to-all
  to full sequence x ``H/P`` heads; the tail padding is cut before attention, so no token attends to it);
- every ``attn2`` (text cross-attention, and the I2V image cross-attention): local queries against the
  replicated text/image keys and values, `sp_cross_attention` (no collective);
- ``norm_out`` input: the shards are all-gathered and the padding dropped, so ``norm_out``/``proj_out`` and
  diffusers' unpatchify run on the full sequence (outside any checkpointed block).

Gradients: each rank computes the loss of the full (gathered) output. `gather_sequence`'s backward sums the
P identical output gradients, so a rank's parameter gradients are ``P`` times its own tokens' share for
everything before the gather and the full gradient for everything after it; averaging over the SP ranks (what
FSDP2's gradient reduction over the world does, `veomni.core.fsdp.apply_fsdp2`) gives exactly the gradient of
one unsplit forward. So the loss needs no SP-specific scaling: P ranks computing the same loss give the
gradient of one.

Why not diffusers' own context parallelism (``_cp_plan`` + ``ContextParallelConfig``, diffusers 0.42): its
``EquipartitionSharder`` asserts that the sequence divides by the mesh size (Wan's ``F*H*W/4`` token counts
often do not), it shards through module hooks keyed on diffusers' device-mesh config rather than veomni's
``ParallelState``, and its gather's backward keeps only this rank's chunk of the output gradient, which is the
gradient of one rank's loss, not the world-averaged convention veomni's FSDP2 uses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.core.sp import gather_sequence, slice_sequence, sp_cross_attention, ulysses_attention, unpad
from veomni.core.sp.attention import kv_repeats_for_sp
from veomni.models.loading.targets import unwrapped_class
from veomni.models.wan.kernels import (  # noqa: F401 - WAN_TEXT_CONTEXT_LEN is part of this module's interface
    DIFFUSERS_OPS,
    WAN_TEXT_CONTEXT_LEN,
    WanKernelAttnProcessor,
    WanOps,
    bound_wan_ops,
)

_MARK = "_veomni_dit_sp"


class _SPContext:
    """Per-model state shared by the hooks and processors: the SP group and the current full token count."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.seq_len: int | None = None
        self.handles: list[Any] = []

    def full_len(self, local_len: int, where: str) -> int:
        if self.seq_len is None:
            raise RuntimeError(f"{where}: called outside a WanTransformer3DModel forward under apply_dit_sp")
        if -(-self.seq_len // self.world) != local_len:
            raise RuntimeError(
                f"{where}: a local shard of {local_len} tokens does not belong to the current forward's "
                f"{self.seq_len} tokens over {self.world} SP ranks (expected ceil(S/P) = "
                f"{-(-self.seq_len // self.world)}); interleaved forwards of different sizes are not supported"
            )
        return self.seq_len


class WanUlyssesAttnProcessor(WanKernelAttnProcessor):
    """A `WanKernelAttnProcessor` for sequence-sharded hidden states (set by `apply_dit_sp`), with the `WanOps` of
    the kernels bound to the model (`veomni.models.wan.kernels.bind_wan_kernels`; diffusers' own code without).

    ``hidden_states`` is ``[B, ceil(S/P), C]`` (this rank's shard, tail-padded on the last ranks),
    ``encoder_hidden_states`` ``[B, L, C]`` replicated (None for self-attention; for I2V ``[B, L_img + 512, C]``)
    and ``rotary_emb`` this rank's ``(cos, sin)`` ``[1, ceil(S/P), 1, D]``. Returns ``[B, ceil(S/P), C]``.
    Self-attention goes through `ulysses_attention` (all-to-all to the full sequence and ``H/P`` heads, the tail
    padding cut before attending); cross-attention attends the local queries to the replicated keys and values
    (`sp_cross_attention`, no collective). diffusers' own context-parallel config is not used.
    """

    def __init__(self, context: _SPContext, ops: WanOps = DIFFUSERS_OPS) -> None:
        super().__init__(ops)
        self._context = context

    def _attend_self(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = self._context
        full = ctx.full_len(q.shape[1], "WanUlyssesAttnProcessor (self-attention)")
        return ulysses_attention(q, k, v, self.attend, ctx.group, seq_dim=1, head_dim=2, unpadded_len=full)

    def _attend_cross(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sp_cross_attention(q, k, v, self.attend, seq_dim=1, head_dim=2)


def _wan_class() -> type:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


def check_dit_sp_supported(cls: type, sp: int, num_heads: int | None = None) -> None:
    """Refuse a diffusers class (before anything is built) or a head count that `apply_dit_sp` cannot split.

    Raises:
        ValueError: ``cls`` is not (a subclass of) ``WanTransformer3DModel``, or ``num_heads % sp != 0``.
    """
    if not issubclass(cls, _wan_class()):
        raise ValueError(
            f"build_model: Ulysses sequence parallelism (sp={sp}) is implemented for diffusers' "
            f"WanTransformer3DModel only, not for {cls.__name__}; use sp=1"
        )
    if num_heads is not None:
        kv_repeats_for_sp(num_heads, num_heads, sp)


def _forward_pre_hook(ctx: _SPContext, patch_size: tuple[int, int, int]):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        if hidden is None or hidden.dim() != 5:
            raise ValueError(
                "WanTransformer3DModel under SP expects hidden_states [B, C, F, H, W], got "
                f"{None if hidden is None else tuple(hidden.shape)}"
            )
        if timestep is not None and timestep.dim() == 2:
            raise ValueError(
                "WanTransformer3DModel under SP: per-token timesteps [B, S] (Wan2.2 TI2V) are not supported "
                f"yet, got timestep of shape {tuple(timestep.shape)}; pass one timestep per sample [B]"
            )
        p_t, p_h, p_w = patch_size
        _, _, f, h, w = hidden.shape
        ctx.seq_len = (f // p_t) * (h // p_h) * (w // p_w)

    return hook


def _rope_hook(ctx: _SPContext):
    def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
        return tuple(slice_sequence(t, 1, ctx.group) for t in output)

    return hook


def _first_block_hook(ctx: _SPContext):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs["hidden_states"], ()
        if hidden.shape[1] != ctx.seq_len:
            raise RuntimeError(
                f"apply_dit_sp: the first block got {hidden.shape[1]} tokens, expected the full sequence of "
                f"{ctx.seq_len}"
            )
        sliced = slice_sequence(hidden, 1, ctx.group)
        if args:
            return (sliced, *rest), kwargs
        return args, {**kwargs, "hidden_states": sliced}

    return hook


def _norm_out_hook(ctx: _SPContext):
    def hook(module: nn.Module, args: tuple):
        local = args[0]
        full = ctx.full_len(local.shape[1], "apply_dit_sp (gather before norm_out)")
        gathered = gather_sequence(local, ctx.group, dim=1, equal_sizes=True)
        return (unpad(gathered, 1, full), *args[1:])

    return hook


def apply_dit_sp(model: nn.Module, state: ParallelState) -> nn.Module:
    """Make a ``WanTransformer3DModel`` (plain or FSDP2-sharded) Ulysses sequence-parallel over
    ``state.sp_group``; return it.

    Every rank of an SP group must then call the model with the same full inputs (latents
    ``[B, C, F, H, W]``, timesteps ``[B]``, text context ``[B, L, text_dim]``, I2V image embeds); each computes
    ``1/P`` of the token rows through the blocks and the full output ``[B, C_out, F, H, W]``, identical on
    every rank. Token counts ``F*H*W/prod(patch_size)`` not divisible by ``P`` are padded and the padding is
    never attended to. Gradient convention: see the module docstring (average over the SP ranks).

    Raises:
        ValueError: ``state`` has ``sp == 1``; ``model`` is not a ``WanTransformer3DModel``; its heads do not
            divide by ``sp``; SP was already applied.
    """
    if not state.sp_enabled:
        raise ValueError(
            f"apply_dit_sp: the parallel state has sp={state.dims.sp}; nothing to apply (use sp > 1)"
        )
    cls = unwrapped_class(model)
    check_dit_sp_supported(cls, state.dims.sp, model.config.num_attention_heads)
    if getattr(model, _MARK, None) is not None:
        raise ValueError("apply_dit_sp: sequence parallelism is already applied to this model")
    if len(model.blocks) == 0:
        raise ValueError("apply_dit_sp: the model has no transformer blocks to shard the sequence through")
    ctx = _SPContext(state.sp_group)
    # Kernels bound before SP (`bind_wan_kernels`) stay bound; binding them later swaps the ops in place.
    processor = WanUlyssesAttnProcessor(ctx, bound_wan_ops(model))
    for block in model.blocks:
        for attn in (block.attn1, block.attn2):
            attn.set_processor(processor)
    patch = tuple(model.config.patch_size)
    ctx.handles = [
        model.register_forward_pre_hook(_forward_pre_hook(ctx, patch), with_kwargs=True),
        model.rope.register_forward_hook(_rope_hook(ctx)),
        model.blocks[0].register_forward_pre_hook(_first_block_hook(ctx), with_kwargs=True),
        model.norm_out.register_forward_pre_hook(_norm_out_hook(ctx)),
    ]
    setattr(model, _MARK, ctx)
    return model
