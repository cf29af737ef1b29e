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

# diffusers' WanAttnProcessor hard-codes it too: the I2V context is [image tokens; 512 text tokens].
WAN_TEXT_CONTEXT_LEN = 512
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


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Wan's interleaved-pair rotation, as diffusers' WanAttnProcessor applies it (same ops, same dtypes).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _self_qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(x).chunk(3, dim=-1)
    return attn.to_q(x), attn.to_k(x), attn.to_v(x)


def _cross_kv(attn: nn.Module, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        return attn.to_kv(context).chunk(2, dim=-1)
    return attn.to_k(context), attn.to_v(context)


def _image_kv(attn: nn.Module, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        return attn.to_added_kv(context).chunk(2, dim=-1)
    return attn.add_k_proj(context), attn.add_v_proj(context)


class WanUlyssesAttnProcessor:
    """A ``WanAttention`` processor for sequence-sharded hidden states (set by `apply_dit_sp`).

    Called by diffusers as ``processor(attn, hidden_states, encoder_hidden_states, attention_mask,
    rotary_emb)`` with ``hidden_states`` ``[B, ceil(S/P), C]`` (this rank's shard, tail-padded on the last
    ranks), ``encoder_hidden_states`` ``[B, L, C]`` replicated (``None`` for self-attention; for I2V
    ``[B, L_img + 512, C]``) and ``rotary_emb`` this rank's ``(cos, sin)`` ``[1, ceil(S/P), 1, D]`` (float64
    in diffusers). Returns ``[B, ceil(S/P), C]`` in the dtype of the query projection.

    The attention itself goes through diffusers' ``dispatch_attention_fn`` (``[B, S, H, D]`` layout), so a
    backend chosen with diffusers' ``set_attention_backend`` is honoured; diffusers' own context-parallel
    config is not used.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, context: _SPContext) -> None:
        self._context = context

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError(
                "WanUlyssesAttnProcessor: an attention_mask over the sharded sequence is not supported (Wan "
                f"passes none); got one of shape {tuple(attention_mask.shape)}"
            )
        if encoder_hidden_states is None:
            out = self._self_attention(attn, hidden_states, rotary_emb)
        else:
            out = self._cross_attention(attn, hidden_states, encoder_hidden_states)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    def _self_attention(
        self, attn: nn.Module, x: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        ctx = self._context
        full = ctx.full_len(x.shape[1], "WanUlyssesAttnProcessor (self-attention)")
        q, k, v = _self_qkv(attn, x)
        # RMSNorm across all heads of one token: local to the token, so exact on the shard.
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _apply_rotary(q, *rotary_emb), _apply_rotary(k, *rotary_emb)
        out = ulysses_attention(q, k, v, self._attend, ctx.group, seq_dim=1, head_dim=2, unpadded_len=full)
        return out.flatten(2, 3).type_as(q)

    def _cross_attention(self, attn: nn.Module, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        image_context = None
        if attn.add_k_proj is not None:
            image_len = context.shape[1] - WAN_TEXT_CONTEXT_LEN
            if image_len < 0:
                raise ValueError(
                    "WanUlyssesAttnProcessor: an I2V cross-attention expects [image tokens; "
                    f"{WAN_TEXT_CONTEXT_LEN} text tokens] as its context, got {context.shape[1]} tokens"
                )
            image_context, context = context[:, :image_len], context[:, image_len:]
        q = attn.norm_q(attn.to_q(x))
        k, v = _cross_kv(attn, context)
        k = attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        image_out = None
        if image_context is not None:
            k_img, v_img = _image_kv(attn, image_context)
            k_img = attn.norm_added_k(k_img)
            k_img, v_img = (t.unflatten(2, (attn.heads, -1)) for t in (k_img, v_img))
            image_out = sp_cross_attention(q, k_img, v_img, self._attend, seq_dim=1, head_dim=2)
            image_out = image_out.flatten(2, 3).type_as(q)
        out = sp_cross_attention(q, k, v, self._attend, seq_dim=1, head_dim=2).flatten(2, 3).type_as(q)
        return out if image_out is None else out + image_out


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
    processor = WanUlyssesAttnProcessor(ctx)
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
