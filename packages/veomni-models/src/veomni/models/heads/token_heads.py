"""Token classification and extractive question answering on veomni's patched decoders.

transformers' ``GenericForTokenClassification`` / ``GenericForQuestionAnswering`` build their decoder through
``AutoModel.from_config``: transformers' own, unpatched base model, which no kernel, veomni mask or Ulysses SP path
reaches. `init_token_classifier` / `init_question_answering` are the bodies of the ``__init__`` patchgen injects
into every registered family's ``*ForTokenClassification`` / ``*ForQuestionAnswering``: upstream's, with the
generated module's patched base model under the same attribute (``model``; ``transformer`` for question
answering), so parameter names, shapes and initialisation -- and checkpoints -- are upstream's.

The forwards (`token_classification_forward`, `question_answering_forward`) are upstream's without Ulysses SP.
Under SP each rank runs its shard of the sequence (``input_ids`` and ``position_ids`` sliced with
``veomni.core.sp.slice_sequence``) and the loss follows veomni's convention: summed over the SP ranks it is the
loss of the whole sequence, and so are the gradients.

* Token classification is per token: logits stay this rank's shard ``[B, S_local, C]`` and ``labels`` are this
  rank's shard too (the SP padding labelled ``-100``). The loss is the shard's cross-entropy sum over the valid
  tokens of the whole sequence (their count all-reduced over the SP group), or over ``num_items_in_batch`` when
  the caller gives it, as upstream divides.
* Question answering softmaxes the start / end logits over the whole sequence, so the ``[B, S_local, 2]`` logits
  are gathered over the SP group (differentiably; cut to ``sp_unpadded_len`` when given, as the attention reads
  it) and every rank returns the full ``[B, S]`` start / end logits; ``start_positions`` / ``end_positions`` are
  positions in the full sequence. Each rank's loss is upstream's loss over the full logits divided by the SP size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.cache_utils import Cache
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_layers import GenericForQuestionAnswering, GenericForTokenClassification
from transformers.modeling_outputs import QuestionAnsweringModelOutput, TokenClassifierOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from veomni.core.sp import gather_sequence
from veomni.models.hf.attention_inputs import current_sp_state

IGNORE_INDEX = -100
__all__ = [
    "init_question_answering",
    "init_token_classifier",
    "qa_forward",
    "question_answering_forward",
    "token_classification_forward",
    "token_cls_forward",
]


def _init_base(
    model: PreTrainedModel,
    config: PreTrainedConfig,
    base_model_class: type[PreTrainedModel],
    generic: type,
) -> None:
    if not isinstance(model, generic):
        raise TypeError(f"expected a {generic.__name__} subclass, got {type(model).__name__}")
    expected = base_model_class.config_class
    if not isinstance(config, expected):
        raise TypeError(
            f"{type(model).__name__}: the base model {base_model_class.__name__} takes a {expected.__name__}, got "
            f"{type(config).__name__}"
        )
    # Skip the generic head's __init__ (it would build transformers' AutoModel decoder first): the next __init__ in
    # the MRO is the family's PreTrainedModel, i.e. what upstream's super().__init__ reaches.
    super(generic, model).__init__(config)
    # _from_config: what AutoModel.from_config itself calls for the class it resolves (dtype, attention handling).
    setattr(model, model.base_model_prefix, base_model_class._from_config(config))


def init_token_classifier(
    model: PreTrainedModel, config: PreTrainedConfig, base_model_class: type[PreTrainedModel]
) -> None:
    """``GenericForTokenClassification.__init__`` with the decoder built as ``base_model_class``.

    Builds, as upstream does: the decoder under ``model.base_model_prefix``, ``dropout`` (``classifier_dropout``,
    else ``hidden_dropout``, else 0.1), the ``score`` head ``[num_labels, hidden]`` (bias unless
    ``config.token_classification_bias`` is False), then ``post_init``.

    Args:
        model: the ``*ForTokenClassification`` being constructed.
        config: its config; must be an instance of ``base_model_class.config_class``.
        base_model_class: the generated module's patched base model (``Qwen3Model``, ...).
    """
    _init_base(model, config, base_model_class, GenericForTokenClassification)
    model.num_labels = config.num_labels
    if getattr(config, "classifier_dropout", None) is not None:
        dropout = config.classifier_dropout
    elif getattr(config, "hidden_dropout", None) is not None:
        dropout = config.hidden_dropout
    else:
        dropout = 0.1
    model.dropout = nn.Dropout(dropout)
    model.score = nn.Linear(
        config.get_text_config().hidden_size,
        config.num_labels,
        bias=getattr(config, "token_classification_bias", True),
    )
    model.post_init()


def init_question_answering(
    model: PreTrainedModel, config: PreTrainedConfig, base_model_class: type[PreTrainedModel]
) -> None:
    """``GenericForQuestionAnswering.__init__`` with the decoder built as ``base_model_class``: the decoder under
    ``model.base_model_prefix`` (``transformer`` in transformers' decoder QA heads), ``qa_outputs`` ``[2, hidden]``
    with bias, ``post_init``. Arguments as `init_token_classifier`."""
    _init_base(model, config, base_model_class, GenericForQuestionAnswering)
    model.qa_outputs = nn.Linear(config.hidden_size, 2)
    model.post_init()


def token_classification_forward(
    model: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> TokenClassifierOutput:
    """``*ForTokenClassification.forward``: upstream's, and under Ulysses SP the sharded loss of the module doc.

    Args (HF's): input_ids ``[B, S]`` (under SP: this rank's ``[B, S_local]``); labels the same shape, int64
    class ids, ``-100`` ignored.
    Returns:
        ``TokenClassifierOutput``: logits ``[B, S(_local), C]``; loss 0-d fp32 when labels are given.
    Raises:
        ValueError: under SP, labels whose shape is not this rank's ``[B, S_local]``.
    """
    state = current_sp_state()
    if state is None:
        return GenericForTokenClassification.forward(
            model, input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
            **kwargs,
        )  # fmt: skip
    outputs = getattr(model, model.base_model_prefix)(
        input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )  # fmt: skip
    logits = model.score(model.dropout(outputs.last_hidden_state))
    loss = None
    if labels is not None:
        if tuple(labels.shape) != tuple(logits.shape[:2]):
            raise ValueError(
                f"{type(model).__name__} under Ulysses SP (sp={state.dims.sp}) takes this rank's shard of the "
                f"labels, shaped like its tokens {tuple(logits.shape[:2])}; got {tuple(labels.shape)} (slice them "
                "with veomni.core.sp.slice_sequence(labels, 1, group, pad_value=-100))"
            )
        ignore = kwargs.get("ignore_index", IGNORE_INDEX)
        labels = labels.to(logits.device)
        flat = logits.float().reshape(-1, logits.shape[-1])
        loss_sum = nn.functional.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore, reduction="sum")
        divisor = kwargs.get("num_items_in_batch")
        if divisor is None:
            divisor = (labels != ignore).sum().to(loss_sum.dtype)
            dist.all_reduce(divisor, group=state.sp_group)
            divisor = divisor.clamp(min=1)
        elif torch.is_tensor(divisor):
            divisor = divisor.to(loss_sum.device)
        loss = loss_sum / divisor
    return TokenClassifierOutput(
        loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
    )


def question_answering_forward(
    model: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    start_positions: torch.LongTensor | None = None,
    end_positions: torch.LongTensor | None = None,
    **kwargs: Any,
) -> QuestionAnsweringModelOutput:
    """``*ForQuestionAnswering.forward``: upstream's, and under Ulysses SP the gathered logits of the module doc.

    Args (HF's): input_ids ``[B, S]`` (under SP: this rank's ``[B, S_local]``); start / end positions ``[B]``
    indices into the full sequence. Under SP, ``sp_unpadded_len`` (python int) cuts the gathered logits to the
    real length.
    Returns:
        ``QuestionAnsweringModelOutput``: start / end logits ``[B, S]`` (under SP the full sequence's, on every
        rank); loss 0-d when both positions are given.
    """
    state = current_sp_state()
    if state is None:
        return GenericForQuestionAnswering.forward(
            model, input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, start_positions=start_positions,
            end_positions=end_positions, **kwargs,
        )  # fmt: skip
    outputs = getattr(model, model.base_model_prefix)(
        input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, **kwargs,
    )  # fmt: skip
    logits = model.qa_outputs(outputs.last_hidden_state)  # [B, S_local, 2]
    # The span softmax runs over the whole sequence: gather it (backward sums the ranks' gradients of the slice).
    logits = gather_sequence(logits.contiguous(), state.sp_group, dim=1, equal_sizes=True)
    unpadded = kwargs.get("sp_unpadded_len")
    if unpadded is not None:
        logits = logits[:, :unpadded]
    start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
    loss = None
    if start_positions is not None and end_positions is not None:
        full = model.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        # Every rank computes the same full-sequence loss; summed over the SP ranks (the gather's backward sums
        # their gradients) it must count once.
        loss = full / state.dims.sp
    return QuestionAnsweringModelOutput(
        loss=loss,
        start_logits=start_logits,
        end_logits=end_logits,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@can_return_tuple
def token_cls_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> TokenClassifierOutput:
    # Injected by patchgen as every registered family's *ForTokenClassification.forward.
    return token_classification_forward(
        self, input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **kwargs,
    )  # fmt: skip


@can_return_tuple
def qa_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    start_positions: torch.LongTensor | None = None,
    end_positions: torch.LongTensor | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> QuestionAnsweringModelOutput:
    # Injected by patchgen as every registered family's *ForQuestionAnswering.forward.
    return question_answering_forward(
        self, input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, start_positions=start_positions, end_positions=end_positions, **kwargs,
    )  # fmt: skip
