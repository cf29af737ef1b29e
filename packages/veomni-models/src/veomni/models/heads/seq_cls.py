"""Sequence classification through the kernel registry, and the rule that a fused CE needs a patched forward.

`sequence_classification_forward` is the forward patchgen injects into every ``*ForSequenceClassification`` adapter.
With ``cross_entropy`` set to a non-eager backend it pools the *hidden states* at each row's last non-pad token
(upstream pools the logits; the score head is row-wise linear without bias, so both give the same logits), and a
single-label classification loss goes through ``kernels.get("cross_entropy", "seq_cls")(pooled [B, H],
score.weight [C, H], labels [B])``. Regression and multi-label losses are not cross-entropy: they stay upstream's.
Without kernels, or with ``eager``, upstream's forward runs unchanged.

`init_sequence_classifier` is the body of the ``__init__`` patchgen injects into the same adapters: upstream's
``GenericForSequenceClassification.__init__`` builds its decoder through ``AutoModel.from_config``, which resolves to
transformers' own (unpatched) base model class, so no kernel, Ulysses SP or EP path would reach it; the injected
``__init__`` builds the generated module's patched base model instead, under the same attribute name.

`check_loss_dispatch` enforces that a non-eager ``cross_entropy`` is only ever bound to a model whose forward routes
its loss through veomni (`LOSS_DISPATCHERS`): chosen explicitly for any other loss-computing head it is an error;
left to the hardware default it becomes ``eager`` for that model, logged.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from veomni.kernels import OpsConfig
from veomni.models.hf.attention_inputs import current_sp_state
from veomni.models.hf.kernel_hooks import ATTR

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100
LOSS_DISPATCHERS = ("lm_logits_and_loss", "sequence_classification_forward")
"""Helpers through which a patched forward sends its loss to the ``cross_entropy`` kernel."""
UPSTREAM_LOSS_HELPERS = ("token_classification_forward", "question_answering_forward")
"""Helpers of patched forwards (`veomni.models.heads.token_heads`) that compute their loss upstream's way."""


def last_non_pad_index(
    model: nn.Module, input_ids: torch.Tensor | None, batch_size: int
) -> torch.Tensor | int:
    """Upstream's pooling position: the rightmost token that is not ``pad_token_id`` (left or right padding).

    Returns ``[B]`` int32 indices, or ``-1`` (the last position) without a pad token or without ``input_ids``.
    """
    pad = model.config.get_text_config().pad_token_id
    if pad is None and batch_size != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    if pad is None or input_ids is None:
        return -1
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    return (positions * (input_ids != pad).to(torch.int32)).argmax(-1)


def init_sequence_classifier(
    model: PreTrainedModel, config: PreTrainedConfig, base_model_class: type[PreTrainedModel]
) -> None:
    """``GenericForSequenceClassification.__init__`` with the decoder built as ``base_model_class``.

    Upstream builds ``AutoModel.from_config(config)``; this builds ``base_model_class._from_config(config)`` (what
    ``AutoModel.from_config`` itself calls for the class it resolves: same dtype and attention handling), stored
    under ``model.base_model_prefix``, then the bias-free ``score`` head ``[num_labels, hidden]`` and
    ``post_init``. Parameter names, shapes and initialisation equal upstream's, so checkpoints load and export
    unchanged.

    Args:
        model: the ``*ForSequenceClassification`` instance being constructed (a GenericForSequenceClassification).
        config: its config; must be an instance of ``base_model_class.config_class``.
        base_model_class: the generated module's patched base model (``Qwen3Model``, ...).
    """
    if not isinstance(model, GenericForSequenceClassification):
        raise TypeError(
            f"init_sequence_classifier expects a GenericForSequenceClassification subclass, got "
            f"{type(model).__name__}"
        )
    expected = base_model_class.config_class
    if not isinstance(config, expected):
        raise TypeError(
            f"{type(model).__name__}: the base model {base_model_class.__name__} takes a {expected.__name__}, got "
            f"{type(config).__name__}"
        )
    # Skip GenericForSequenceClassification.__init__ (it would build transformers' AutoModel decoder first): the
    # next __init__ in the MRO is the family's PreTrainedModel, i.e. what upstream's super().__init__ reaches.
    super(GenericForSequenceClassification, model).__init__(config)
    model.num_labels = config.num_labels
    setattr(model, model.base_model_prefix, base_model_class._from_config(config))
    model.score = nn.Linear(config.get_text_config().hidden_size, model.num_labels, bias=False)
    model.post_init()


def _problem_type(config: Any, labels: torch.Tensor) -> str:
    # HF's rule (ForSequenceClassificationLoss), which also records the inferred type on the config.
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def sequence_classification_forward(
    model: nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> SequenceClassifierOutputWithPast:
    """``*ForSequenceClassification.forward`` with the classification CE dispatched through the model's kernels.

    Args (HF's): input_ids ``[B, S]`` or inputs_embeds ``[B, S, H]``; labels ``[B]`` int64 class ids
    (``-100`` ignored), float for regression / multi-label.
    Returns:
        ``SequenceClassifierOutputWithPast`` with pooled logits ``[B, C]`` and the loss (0-d fp32 mean over
        labelled rows; 0, not NaN, when every label is ignored) when labels are given.
    Raises:
        NotImplementedError: under Ulysses SP (a current parallel state with ``sp > 1``).
    """
    sp_state = current_sp_state()
    if sp_state is not None:
        # Each SP rank holds a slice of every row, so the pooled token (the row's last non-pad one) is on one rank
        # only; pooling the local slice would silently classify from the wrong position.
        raise NotImplementedError(
            f"{type(model).__name__} under Ulysses sequence parallelism (sp={sp_state.dims.sp}): sequence "
            "classification pools each row's last non-pad token, which only one SP rank holds, and this forward "
            "does not gather it; train sequence classification with sp=1"
        )
    kernels = getattr(model, ATTR, None)
    if kernels is None or kernels.config.cross_entropy == "eager":
        return GenericForSequenceClassification.forward(
            model, input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
            **kwargs,
        )  # fmt: skip
    outputs = getattr(model, model.base_model_prefix)(
        input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )  # fmt: skip
    hidden = outputs.last_hidden_state
    batch = hidden.shape[0]
    index = last_non_pad_index(model, input_ids, batch)
    if isinstance(index, torch.Tensor):
        index = index.to(hidden.device)
    pooled = hidden[torch.arange(batch, device=hidden.device), index]  # [B, H]
    logits = model.score(pooled)
    loss = None
    if labels is not None:
        labels = labels.to(hidden.device)
        if _problem_type(model.config, labels) == "single_label_classification":
            kernel = kernels.get("cross_entropy", "seq_cls")
            loss_sum, count = kernel(pooled, model.score.weight, labels.view(-1).long())
            loss = loss_sum / count.clamp(min=1)
        else:  # MSE / BCE, not cross-entropy: upstream's loss on the (tiny) pooled logits
            loss = model.loss_function(
                logits=logits, labels=labels, pooled_logits=logits, config=model.config
            )
    return SequenceClassifierOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@can_return_tuple
def seq_cls_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> SequenceClassifierOutputWithPast:
    # Injected by patchgen as every registered family's *ForSequenceClassification.forward.
    return sequence_classification_forward(
        self, input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **kwargs,
    )  # fmt: skip


def _forward_names(cls: type) -> set[str]:
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return set(code.co_names) if code is not None else set()


def loss_dispatch(model: nn.Module) -> str:
    """``"veomni"`` when the forward routes its loss through a `LOSS_DISPATCHERS` helper, ``"upstream"`` when it
    computes a loss itself (it calls ``loss_function``), ``"none"`` for a model without a loss (a base model)."""
    names = _forward_names(type(model))
    if names & set(LOSS_DISPATCHERS):
        return "veomni"
    return "upstream" if "loss_function" in names or names & set(UPSTREAM_LOSS_HELPERS) else "none"


def check_loss_dispatch(model: nn.Module, ops: OpsConfig) -> OpsConfig:
    """``ops`` fit for ``model``'s loss: raise if a non-eager ``cross_entropy`` was *chosen* for a model whose
    forward computes its loss upstream's way (it would silently do nothing); a *defaulted* one becomes
    ``eager`` for this model (logged). ``defaulted`` is unchanged."""
    if ops.cross_entropy == "eager" or loss_dispatch(model) != "upstream":
        return ops
    name = type(model).__name__
    if "cross_entropy" not in ops.defaulted:
        raise ValueError(
            f"OpsConfig.cross_entropy={ops.cross_entropy!r}, but {name}'s forward computes its loss upstream's "
            f"way, which veomni has not patched to dispatch through the kernel registry (only forwards calling "
            f"{list(LOSS_DISPATCHERS)} do: *ForCausalLM, *ForConditionalGeneration and *ForSequenceClassification "
            f"of the registered families). Set cross_entropy='eager' for this model"
        )
    logger.info(
        "apply_ops: %s computes its loss upstream's way; cross_entropy %r -> 'eager'", name, ops.cross_entropy
    )
    return ops.replace(cross_entropy="eager")
