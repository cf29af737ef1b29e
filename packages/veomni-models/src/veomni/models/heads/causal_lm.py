"""The LM head and losses of the generated ``*ForCausalLM`` forwards, dispatched through the instance's kernels.

With ``cross_entropy`` set to a non-eager backend, the hidden states and the LM-head weight go straight to the
kernel (a fused linear cross-entropy never materialises ``[T, V]`` logits) and the output carries no logits.
Otherwise (no kernels attached, or ``eager``) the upstream code runs unchanged: LM head, the config's final logit
soft-cap where it sets one (``final_logit_softcapping``, as Gemma's forwards apply it), then HF's loss function.

Inside `capture_token_log_probs` the same forwards compute no loss: they hand each position's log-probability of
its target to the capture instead (the ``log_probs`` kernel: chunked or fused, never ``[T, V]`` at once), which is
what preference and RL objectives are built from.

Normalisation follows HF's convention so trainers need no special case: the loss is the token-loss sum divided
by ``num_items_in_batch`` when given (a trainer passes the global valid-token count of the whole optimizer step,
which gives veomni-core's "objective = sum over ranks" convention), else by the local valid count — 0, not NaN,
when every label is ignored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import slice_logits_to_keep

from veomni.core.fsdp import forward_through
from veomni.core.sp.real_tokens import real_token_mask
from veomni.kernels.log_probs.chunked import linear_log_probs as chunked_log_probs
from veomni.kernels.moe_loss import load_balancing_loss_global
from veomni.models.hf.attention_inputs import current_sp_state
from veomni.models.hf.kernel_hooks import ATTR

IGNORE_INDEX = -100

_CAPTURE: ContextVar[tuple[list[tuple[torch.Tensor, torch.Tensor | None]], bool] | None] = ContextVar(
    "veomni_token_log_probs", default=None
)


@contextlib.contextmanager
def capture_token_log_probs(
    entropy: bool = False,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """Within the block, a veomni causal-LM forward given ``labels`` or ``shift_labels`` returns ``loss=None`` and
    appends ``(logps, entropy)`` to the yielded list: fp32 ``[B, S]`` log-probabilities of each position's target
    and, with ``entropy``, the entropy of its next-token distribution (else None); 0 where the target is ignored,
    differentiable w.r.t. the hidden states and the LM head. Computed by the model's ``log_probs`` kernel
    (`veomni.kernels.log_probs`: chunked or fused, never ``[T, V]`` outside the eager oracle); one entry per
    forward, in call order."""
    captured: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    token = _CAPTURE.set((captured, entropy))
    try:
        yield captured
    finally:
        _CAPTURE.reset(token)


def lm_logits_and_loss(
    model: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    **loss_kwargs: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Logits and causal-LM loss from the decoder's final hidden states.

    ``logits_to_keep`` is applied to the hidden states first (before any loss), exactly as upstream does.

    Args:
        model: the ``*ForCausalLM`` or a composite's ``*ForConditionalGeneration`` (needs ``lm_head`` and
            ``loss_function``; vocabulary and logit softcap come from ``config.get_text_config()``).
        hidden_states: ``[B, S, H]`` in the model dtype.
        labels: ``[B, S]`` int64 unshifted targets (shifted here), or None.
        logits_to_keep: HF semantics (0 keeps every position).
        loss_kwargs: forwarded to the loss: ``shift_labels`` (``[B, S]`` already-shifted targets, e.g. from a
            packing collator whose samples must not predict across boundaries), ``num_items_in_batch``,
            ``ignore_index``; other model kwargs are ignored by the loss as in HF.
    Returns:
        ``(logits, loss)``: logits ``[B, S', V]`` (None when a fused loss ran), loss 0-d fp32 or None.
    """
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    shift_labels = loss_kwargs.get("shift_labels")
    wants_loss = labels is not None or shift_labels is not None
    kernels = getattr(model, ATTR, None)
    text_config = model.config.get_text_config()
    capture = _CAPTURE.get()
    if wants_loss and capture is not None:
        captured, entropy = capture
        ignore_index = loss_kwargs.get("ignore_index", IGNORE_INDEX)
        if shift_labels is None:
            assert labels is not None
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        kernel = kernels.get("log_probs", "linear") if kernels is not None else chunked_log_probs
        captured.append(
            forward_through(
                model.lm_head, _head_log_probs, kernel, hidden_states, shift_labels.to(hidden_states.device),
                ignore_index=ignore_index, logit_softcap=getattr(text_config, "final_logit_softcapping", None),
                entropy=entropy,
            )
        )  # fmt: skip
        return None, None
    if wants_loss and kernels is not None and kernels.config.cross_entropy != "eager":
        # Through the head's forward hooks: an FSDP unit of its own is gathered, and its gradient reduced, as
        # for a call of lm_head (veomni.core.fsdp.forward_through).
        loss = forward_through(
            model.lm_head,
            _head_loss,
            kernels.get("cross_entropy", "causal"),
            hidden_states,
            labels,
            shift_labels=shift_labels,
            num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
            ignore_index=loss_kwargs.get("ignore_index", IGNORE_INDEX),
            logit_softcap=getattr(text_config, "final_logit_softcapping", None),
        )
        return None, loss
    logits = model.lm_head(hidden_states)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap is not None:
        # Upstream's order (Gemma 2/3): divide, tanh, multiply; the fused branch passes the same cap to its kernel.
        logits = torch.tanh(logits / softcap) * softcap
    loss = None
    if wants_loss:
        target = labels if labels is not None else shift_labels
        loss = model.loss_function(
            logits=logits, labels=target, vocab_size=text_config.vocab_size, **loss_kwargs
        )
    return logits, loss


def _head_log_probs(
    head: nn.Module, kernel: Callable[..., Any], hidden_states: torch.Tensor, targets: torch.Tensor, *,
    ignore_index: int, logit_softcap: float | None, entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    result: tuple[torch.Tensor, torch.Tensor | None] = kernel(
        hidden_states,
        head.weight,
        targets,
        ignore_index=ignore_index,
        logit_softcap=logit_softcap,
        entropy=entropy,
    )
    return result


def _head_loss(
    head: nn.Module, kernel: Callable[..., Any], hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    return fused_causal_lm_loss(kernel, hidden_states, head.weight, *args, **kwargs)


def fused_causal_lm_loss(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Next-token loss through a ``cross_entropy/causal`` kernel taking hidden states and the LM-head weight.

    Args:
        kernel: ``(hidden [..., H], weight [V, H], labels [...]) -> (loss_sum, valid_count)``.
        hidden_states: ``[B, S, H]``; weight: ``[V, H]``.
        labels: ``[B, S]`` unshifted (ignored when ``shift_labels`` is given).
        shift_labels: ``[B, S]`` targets already aligned with ``hidden_states``.
        num_items_in_batch: the divisor (e.g. the global valid-token count); None divides by the local count.
    Returns:
        0-d fp32 loss.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("fused_causal_lm_loss needs labels or shift_labels")
        # Position t predicts token t+1; the last position has no target.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    if shift_labels.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"labels {tuple(shift_labels.shape)} must match the hidden states' positions "
            f"{tuple(hidden_states.shape[:-1])} (did logits_to_keep cut the sequence?)"
        )
    loss_sum, count = kernel(
        hidden_states, weight, shift_labels, ignore_index=ignore_index, logit_softcap=logit_softcap
    )
    if num_items_in_batch is None:
        return loss_sum / count.clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


def router_aux_loss(
    model: nn.Module,
    router_logits: Sequence[torch.Tensor] | None,
    attention_mask: torch.Tensor | None,
    upstream: Callable[..., torch.Tensor | int],
) -> torch.Tensor | None:
    """The load-balancing loss over all MoE layers, or None when there are no router logits to score.

    Upstream returns the int 0 without router logits and then calls ``.to`` on it; returning None lets the
    caller skip the aux term instead. Under Ulysses SP the router statistics are reduced over the SP group first
    (see the body), so the SP ranks' values sum to the loss of the whole sequence; the row's SP padding is left out
    of them when the caller states the real length (`veomni.core.sp.real_tokens.use_real_length`, as the trainer
    does), as one process never routes it.

    Args:
        model: the MoE ``*ForCausalLM`` (``num_experts``, ``num_experts_per_tok``).
        router_logits: one raw ``[T, E]`` tensor per MoE layer (as recorded by HF), or None/empty.
        attention_mask: optional ``[B, S]`` (0 = padding).
        upstream: the model's own ``load_balancing_loss_func``, used when the kernel is eager or absent.
    Returns:
        0-d fp32 loss or None.
    """
    if not router_logits:
        return None
    kernels = getattr(model, ATTR, None)
    sp_state = current_sp_state()
    if sp_state is not None:
        # Each SP rank routes a slice of the sequence; the loss is a nonlinear function of the whole sequence's
        # router statistics, so they are all-reduced over the SP group. The returned value is this rank's
        # contribution: summed over the SP ranks it is the loss of the full sequence (veomni's convention).
        # The SP padding at the row's end goes through the routers too; one process never sees it, so it is
        # masked out of the statistics (the trainer states the real length: veomni.core.sp.real_tokens).
        real = real_token_mask(router_logits[0].shape[0], sp_state.sp_rank, router_logits[0].device)
        if real is not None:
            if attention_mask is not None and attention_mask.numel() != real.numel():
                raise ValueError(
                    f"an attention mask of shape {tuple(attention_mask.shape)} does not cover the "
                    f"{real.numel()} routed tokens of this SP slice"
                )
            real = (
                real[None]
                if attention_mask is None
                else attention_mask.bool() & real.view(attention_mask.shape)
            )
            attention_mask = real.long()
        use_triton = kernels is not None and kernels.config.load_balancing_loss == "triton"
        return load_balancing_loss_global(
            list(router_logits), model.num_experts, model.num_experts_per_tok, attention_mask,
            group=sp_state.sp_group, impl="triton" if use_triton else "eager",
        )  # fmt: skip
    if kernels is not None and kernels.config.load_balancing_loss != "eager":
        kernel = kernels.get("load_balancing_loss", "switch")
        return kernel(list(router_logits), model.num_experts, model.num_experts_per_tok, attention_mask)
    return upstream(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
