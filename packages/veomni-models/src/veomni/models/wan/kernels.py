"""veomni's kernels bound to diffusers' ``WanTransformer3DModel`` (`bind_wan_kernels`), where the maths is diffusers'
own, op for op:

- ``attn.norm_q`` / ``norm_k`` / ``norm_added_k`` (``torch.nn.RMSNorm`` over all heads of a token, affine) ->
  ``rms_norm/standard`` of ``OpsConfig.rms_norm`` (normalise in fp32, round to x's dtype, times the weight:
  ``torch.nn.functional.rms_norm``'s order);
- the rotary embedding of ``WanAttnProcessor`` (pairs ``(2i, 2i+1)`` on ``[B, S, H, D]``) -> ``rope/interleaved``
  of ``OpsConfig.rope``;
- ``dispatch_attention_fn`` (non-causal, no mask, default scale) -> ``attention/default`` of ``OpsConfig.attention``
  (``[B, S, H, D]``: the layout diffusers already uses, so nothing is transposed).

There is no patchgen for diffusers: the hook is diffusers' own attention-processor slot (``set_processor``), and
one processor class, `WanKernelAttnProcessor`, reads which functions to call from a `WanOps`. A field left
``eager`` in the `OpsConfig` keeps diffusers' own code for that op (as ``eager`` does in the transformers
adapters); the attention field always names one of our attention kernels. Everything else of the block (FP32
LayerNorms, adaLN scale/shift chains, GELU-tanh FFN) stays diffusers' code and is fused by ``torch.compile`` of
the blocks (`veomni.models.diffusers.build`). Parameters, buffers, FQNs and ``config`` are untouched, so the
diffusers export is unchanged. Ulysses SP (`veomni.models.wan.sp`) subclasses the processor and keeps the ops.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from veomni.kernels import Kernels, OpsConfig, resolve_kernels
from veomni.models.hf.kernel_hooks import attach_kernels
from veomni.models.loading.targets import unwrapped_class

logger = logging.getLogger(__name__)

# diffusers' WanAttnProcessor hard-codes it too: the I2V context is [image tokens; 512 text tokens].
WAN_TEXT_CONTEXT_LEN = 512
OPS_ATTR = "_veomni_wan_ops"


@attrs.frozen(eq=False)
class WanOps:
    """The functions a `WanKernelAttnProcessor` calls; ``None`` = diffusers' own code for that op.

    Attributes:
        rms_norm: ``f(x [..., C], weight [C], eps) -> [..., C]`` (``rms_norm/standard``) or None (the module).
        rope: ``f(q [B, S, H, D], k, cos, sin) -> (q, k)`` (``rope/interleaved``) or None (diffusers' formula).
        attention: ``f(q, k, v, *, causal) -> out``, all ``[B, S, H, D]`` (``attention/default``) or None
            (``dispatch_attention_fn`` with the processor's diffusers backend).
        names: the backend of each field, for logs and benchmark records (``{"rms_norm": "triton", ...}``).
    """

    rms_norm: Callable[..., torch.Tensor] | None = None
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    attention: Callable[..., torch.Tensor] | None = None
    names: dict[str, str] = attrs.field(factory=dict)


DIFFUSERS_OPS = WanOps(names={"rms_norm": "diffusers", "rope": "diffusers", "attention": "diffusers"})


def wan_ops(kernels: Kernels) -> WanOps:
    """The `WanOps` of a resolved kernel set: ``eager`` rms_norm/rope keep diffusers' code, others take ours.

    Raises:
        ValueError: an explicitly chosen rope backend has no ``interleaved`` variant (liger, npu), naming those that
            have one; a *defaulted* one (npu) keeps diffusers' rotary with a warning.
    """
    config = kernels.config
    rms_norm = None if config.rms_norm == "eager" else kernels.get("rms_norm", "standard")
    rope, rope_name = None, config.rope
    if config.rope != "eager":
        try:
            rope = kernels.get("rope", "interleaved")
        except KeyError as err:
            have = [
                b for b in config.registry.backends("rope") if _has_variant(config, "rope", "interleaved", b)
            ]
            if "rope" not in config.defaulted:
                raise ValueError(
                    f"WanTransformer3DModel rotates interleaved pairs, but OpsConfig.rope={config.rope!r} has no "
                    f"rope/interleaved kernel ({err.args[0]}); choose one of {have} ('eager' keeps diffusers' code)"
                ) from None
            # The device default (npu) lacks the variant: loud, not an error.
            logger.warning(
                "OpsConfig.rope: the %s default %r has no rope/interleaved kernel; WanTransformer3DModel keeps "
                "diffusers' rotary (backends with one: %s)", config.hardware.device_type, config.rope, have,
            )  # fmt: skip
            rope_name = "diffusers"
    attention = kernels.get("attention", "default")
    names = {"rms_norm": config.rms_norm, "rope": rope_name, "attention": config.attention}
    return WanOps(rms_norm=rms_norm, rope=rope, attention=attention, names=names)


def _has_variant(config: OpsConfig, op: str, variant: str, backend: str) -> bool:
    try:
        config.registry.get(op, variant, backend)
    except KeyError:
        return False
    return True


def diffusers_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanAttnProcessor`` rotary on ``x [B, S, H, D]`` with ``cos``/``sin`` ``[1, S, 1, D]``: the
    same ops in the same dtypes (the tables' dtype, float64 for Wan), used when ``OpsConfig.rope`` is eager."""
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


class WanKernelAttnProcessor:
    """A ``WanAttention`` processor computing diffusers' ``WanAttnProcessor`` with the functions of a `WanOps`.

    Called by diffusers as ``processor(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)``:
    ``hidden_states`` ``[B, S, C]``; ``encoder_hidden_states`` None for self-attention, ``[B, L, C]`` for the text
    cross-attention (I2V: ``[B, L_img + 512, C]``); ``rotary_emb`` ``(cos, sin)`` ``[1, S, 1, D]`` (float64 in
    diffusers) or None. Returns ``[B, S, C]`` in the query projection's dtype. Subclasses change how the heads
    attend (`_attend_self`, `_attend_cross`): Ulysses SP in `veomni.models.wan.sp`.
    """

    # diffusers' set_attention_backend writes these on every processor; only used with WanOps.attention None.
    _attention_backend = None
    _parallel_config = None

    def __init__(self, ops: WanOps = DIFFUSERS_OPS) -> None:
        if not isinstance(ops, WanOps):
            raise TypeError(f"WanKernelAttnProcessor expects a WanOps, got {type(ops).__name__}")
        self.ops = ops

    def with_ops(self, ops: WanOps) -> WanKernelAttnProcessor:
        """A copy of this processor (its SP context included) calling ``ops``."""
        other = copy.copy(self)
        other.ops = ops
        return other

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention of ``q [B, S, H, D]`` to ``k, v [B, Sk, H, D]`` -> ``[B, S, H, D]``."""
        if self.ops.attention is not None:
            return self.ops.attention(q, k, v, causal=False)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )

    def _attend_self(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend(q, k, v)

    def _attend_cross(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend(q, k, v)

    def _norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.ops.rms_norm is None:
            return module(x)
        return self.ops.rms_norm(x, module.weight, module.eps)

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rotary_emb is None:
            return q, k
        if self.ops.rope is None:
            return diffusers_rotary(q, *rotary_emb), diffusers_rotary(k, *rotary_emb)
        return self.ops.rope(q, k, *rotary_emb)

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
                f"{type(self).__name__}: attention masks are not supported (Wan passes none); got one of shape "
                f"{tuple(attention_mask.shape)}"
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
        q, k, v = _self_qkv(attn, x)
        # RMSNorm across all heads of one token: local to the token (so exact on an SP shard too).
        q, k = self._norm(attn.norm_q, q), self._norm(attn.norm_k, k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        q, k = self._rotate(q, k, rotary_emb)
        return self._attend_self(q, k, v).flatten(2, 3).type_as(q)

    def _cross_attention(self, attn: nn.Module, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        image_context = None
        if attn.add_k_proj is not None:
            image_len = context.shape[1] - WAN_TEXT_CONTEXT_LEN
            if image_len < 0:
                raise ValueError(
                    f"{type(self).__name__}: an I2V cross-attention expects [image tokens; "
                    f"{WAN_TEXT_CONTEXT_LEN} text tokens] as its context, got {context.shape[1]} tokens"
                )
            image_context, context = context[:, :image_len], context[:, image_len:]
        q = self._norm(attn.norm_q, attn.to_q(x))
        k, v = _cross_kv(attn, context)
        k = self._norm(attn.norm_k, k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        image_out = None
        if image_context is not None:
            k_img, v_img = _image_kv(attn, image_context)
            k_img = self._norm(attn.norm_added_k, k_img)
            k_img, v_img = (t.unflatten(2, (attn.heads, -1)) for t in (k_img, v_img))
            image_out = self._attend_cross(q, k_img, v_img).flatten(2, 3).type_as(q)
        out = self._attend_cross(q, k, v).flatten(2, 3).type_as(q)
        return out if image_out is None else out + image_out


def _wan_class() -> type:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


def _check_norms(model: nn.Module) -> None:
    # The kernel takes (x, weight, eps): a norm without an affine weight or with eps=None (dtype's machine
    # epsilon in torch) would need another variant; Wan builds neither, a modified config could.
    for name, module in model.named_modules():
        is_qk_norm = name.rsplit(".", 1)[-1] in ("norm_q", "norm_k", "norm_added_k")
        if is_qk_norm and (not isinstance(module, nn.RMSNorm) or module.weight is None or module.eps is None):
            raise ValueError(
                f"bind_wan_kernels: {name} must be an affine torch.nn.RMSNorm with an explicit eps for "
                f"rms_norm/standard, found {module!r}; use ops.rms_norm='eager' to keep diffusers' code"
            )


def bind_wan_kernels(model: nn.Module, ops: OpsConfig) -> WanOps:
    """Route every ``WanAttention`` of ``model`` (plain or FSDP2-wrapped, with or without Ulysses SP) through
    ``ops``'s kernels; return the bound `WanOps` (also ``model._veomni_wan_ops``).

    The model's ``veomni_kernels`` attribute (every submodule) holds the resolved kernel set, as for transformers
    models (`veomni.models.hf.kernel_hooks.attach_kernels`). A processor `apply_dit_sp` installed keeps its SP
    context and takes the new ops; diffusers' own ``WanAttnProcessor`` is replaced.

    Raises:
        ValueError: ``model`` is not a ``WanTransformer3DModel``; a processor that is neither diffusers'
            ``WanAttnProcessor`` nor ours (someone else's, which would be dropped silently); a q/k norm that
            ``rms_norm/standard`` cannot compute; a rope backend without ``interleaved``.
        TypeError: ``ops`` is not an `OpsConfig`.
    """
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    if not isinstance(ops, OpsConfig):
        raise TypeError(f"bind_wan_kernels: ops must be a veomni.kernels.OpsConfig, got {type(ops).__name__}")
    cls = unwrapped_class(model)
    if not issubclass(cls, _wan_class()):
        raise ValueError(
            f"bind_wan_kernels: veomni's kernels are bound to diffusers' WanTransformer3DModel only, not to "
            f"{cls.__name__}; build it with ops=None"
        )
    if ops.rms_norm != "eager":
        _check_norms(model)
    kernels = resolve_kernels(ops)
    bound = wan_ops(kernels)
    attentions = [m for m in model.modules() if isinstance(m, WanAttention)]
    for module in attentions:
        processor = module.processor
        # Exactly diffusers' default, or ours: anything else (a subclass included) is someone's change we would drop.
        if type(processor) is not WanAttnProcessor and not isinstance(processor, WanKernelAttnProcessor):
            raise ValueError(
                f"bind_wan_kernels: a WanAttention has processor {type(processor).__name__}, which veomni "
                "would replace; bind the kernels to a model with diffusers' WanAttnProcessor or veomni's"
            )
    for module in attentions:
        current = module.processor
        if isinstance(current, WanKernelAttnProcessor):
            module.set_processor(current.with_ops(bound))
        else:
            module.set_processor(WanKernelAttnProcessor(bound))
    attach_kernels(model, kernels)
    object.__setattr__(model, OPS_ATTR, bound)
    logger.info("bind_wan_kernels: %d WanAttention modules use %s", len(attentions), bound.names)
    return bound


def bound_wan_ops(model: nn.Module) -> WanOps:
    """The `WanOps` `bind_wan_kernels` bound to ``model``, or `DIFFUSERS_OPS` when none were."""
    ops: Any = getattr(model, OPS_ATTR, None)
    return DIFFUSERS_OPS if ops is None else ops
