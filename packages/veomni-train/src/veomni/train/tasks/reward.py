"""Reward models on chosen/rejected pairs (``model.task: reward``): a ``*ForSequenceClassification`` with one label
scores each answer at its last token, trained with the Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)``
(TRL's ``RewardTrainer``, tests/train/test_reward_trl.py), exported as a plain transformers sequence-classification
model (``AutoModelForSequenceClassification.from_pretrained``).

Pairs are packed as for DPO (`veomni.train.data.pairs`: segment ``2i`` the chosen answer, ``2i + 1`` the rejected
one). The backbone runs once on the packed row and the score head only on each segment's last hidden state (the
head pools the row's last token, so a packed row would give one score). Under Ulysses SP a segment's last token
lives on one rank: each rank scores the ends it holds and the scores are all-reduced over the SP group with an
autograd-aware all-reduce, as the dpo task does with its log-probability sums.

Starting from a causal-LM checkpoint (the usual case: an SFT model), the checkpoint has no ``score.weight`` and an
``lm_head`` the classifier does not use: the head starts at zero (every reward 0, the first loss ``log 2``; said in
the log) and the LM head is skipped. A sequence-classification checkpoint with one label loads as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from veomni.core.fsdp import forward_through
from veomni.core.parallel_state import ParallelState
from veomni.train.data import Step, model_inputs
from veomni.train.preflight import PreflightError
from veomni.train.tasks import TaskSetup
from veomni.train.tasks.preference import PairOutputs, pair_counts, pair_layout, sp_position
from veomni.train.tasks.text import TextTask, prepare_transformers_task

if TYPE_CHECKING:
    from veomni.train.recipe import Recipe

log = logging.getLogger("veomni.train")

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
"""Per-step means over the step's pairs."""

HEAD = "score.weight"
"""The reward head's parameter (transformers' ``*ForSequenceClassification``)."""


@attrs.define(kw_only=True)
class RewardTask:
    """A Bradley-Terry reward model (module docstring).

    Attributes:
        text: the `TextTask` of the same model (FLOPs, export, tokenizer files).
        state: the run's parallel state (SP rank, group and degree).
    """

    text: TextTask
    state: ParallelState | None = None
    _metrics: dict[str, torch.Tensor] = attrs.field(factory=dict)
    name: ClassVar[str] = "reward"
    model_task: ClassVar[str] = "sequence_classification"
    data_kinds: ClassVar[tuple[str, ...]] = ("preference",)
    metric_names: ClassVar[tuple[str, ...]] = METRICS
    console_metrics: ClassVar[tuple[str, ...]] = ("rewards/margin", "rewards/accuracy")

    @property
    def aux_loss_coef(self) -> float:
        return 0.0

    @classmethod
    def for_model(cls, probe: nn.Module) -> RewardTask:
        return cls(text=TextTask.for_model(probe))

    @classmethod
    def prepare(cls, recipe: Recipe, state: ParallelState, device: torch.device) -> TaskSetup:
        """`TaskSetup` of a transformers task with one label, after the checks a reward model needs."""
        recipe = one_label(recipe)
        check_reward_recipe(recipe)
        setup = prepare_transformers_task(cls, recipe, state, device)
        if setup.config.get_text_config().num_labels != 1:
            raise PreflightError(f"model.task=reward needs num_labels 1, found {setup.config.num_labels}")
        if TextTask.for_model(setup.probe).aux_loss_coef:
            raise PreflightError(
                "model.task=reward trains dense models for now: the MoE load-balancing loss of "
                f"{setup.config.model_type!r} would not be applied"
            )
        setup.task.state = state
        return setup

    @classmethod
    def build_args(cls, recipe: Recipe) -> dict[str, Any]:
        """`veomni.models.build.build_model` arguments for a start from a causal-LM checkpoint (module docstring)."""
        if recipe.model.weights is None or HEAD in checkpoint_keys(recipe.model.weights):
            return {}
        log.info(
            "reward: %s holds no %s (a causal LM): the reward head starts at zero, the LM head is skipped",
            recipe.model.weights, HEAD,
        )  # fmt: skip
        return {"zero_init": (HEAD,), "ignore_unexpected": (r"^lm_head\.",)}

    def data_options(self) -> dict[str, Any]:
        return {}

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        kwargs = model_inputs(dict(batch), device)
        kwargs["use_cache"] = False
        return kwargs

    def segment_rewards(self, model: nn.Module, batch: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        """fp32 ``[2 * pairs]``: each answer's reward (chosen, rejected, chosen, ...), summed over the SP group."""
        sp_rank, sp = sp_position(self.state)
        layout = pair_layout(batch, sp_rank, sp)
        local = batch["input_ids"].shape[1]
        ends = batch["cu_seqlens"].numpy().astype(np.int64)[1 : 2 * layout.pairs + 1] - 1 - sp_rank * local
        here = torch.from_numpy((ends >= 0) & (ends < local)).to(device, non_blocking=True)
        at = torch.from_numpy(np.clip(ends, 0, local - 1)).to(device, non_blocking=True)
        rewards = forward_through(model, _rewards_at, self.model_kwargs(batch, device, at), at, here)
        if sp > 1:
            assert self.state is not None
            rewards = differentiable_all_reduce(rewards, group=self.state.sp_group)
        return rewards  # type: ignore[no-any-return]

    def forward(
        self, model: nn.Module, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> PairOutputs:
        """The Bradley-Terry loss of one micro-batch's pairs, over ``num_items[0]`` pairs in the step."""
        rewards = self.segment_rewards(model, batch, device)
        chosen, rejected = rewards[0::2], rewards[1::2]
        valid = pair_layout(batch, *sp_position(self.state)).valid.to(device, non_blocking=True)
        weight = valid.float() / (num_items[0] * sp_position(self.state)[1])
        loss = (-F.logsigmoid(chosen - rejected) * weight).sum()
        values = (chosen, rejected, chosen - rejected, (chosen > rejected).float())
        self._metrics = {n: (v.detach() * weight).sum() for n, v in zip(METRICS, values, strict=True)}
        return PairOutputs(loss=loss, aux_loss=None, metrics=self._metrics)

    @torch.no_grad()
    def eval_sums(self, model: nn.Module, batch: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        """This rank's share of fp32 ``[loss, correctly ordered pairs, margin, pairs]`` of one batch."""
        rewards = self.segment_rewards(model, batch, device)
        chosen, rejected = rewards[0::2], rewards[1::2]
        sp_rank, _ = sp_position(self.state)
        valid = pair_layout(batch, *sp_position(self.state)).valid.to(device).float() * (sp_rank == 0)
        return torch.stack([
            (-F.logsigmoid(chosen - rejected) * valid).sum(), ((chosen > rejected).float() * valid).sum(),
            ((chosen - rejected) * valid).sum(), valid.sum(),
        ])  # fmt: skip

    def eval_results(self, totals: torch.Tensor) -> dict[str, float]:
        loss, correct, margin, pairs = totals.tolist()
        if pairs == 0:
            raise ValueError("evaluation: data.eval_files hold no preference pair")
        return {"eval_loss": loss / pairs, "eval_rewards/accuracy": correct / pairs, "eval_rewards/margin": margin / pairs}

    def step_normaliser(self, step: Step, device: torch.device) -> torch.Tensor:
        return pair_counts(step, self.state, device)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        return self._metrics

    def trained_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return torch.tensor(2 * len(batch["sample_index"]), dtype=torch.int64)

    def loss(self, outputs: PairOutputs, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.loss, outputs.loss

    def export(self, model: nn.Module, out: Path, tokenizer: Any, parallel_state: ParallelState) -> None:
        self.text.export(model, out, tokenizer, parallel_state)

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        self.text.checkpoint_files(model, out, tokenizer)

    def step_flops(self, step: Step) -> float:
        return self.text.step_flops(step)


def _rewards_at(model: nn.Module, kwargs: dict[str, Any], at: torch.Tensor, here: torch.Tensor) -> torch.Tensor:
    """The score head on the hidden states at positions ``at`` of the packed row (0 where not ``here``)."""
    hidden = getattr(model, model.base_model_prefix)(**kwargs).last_hidden_state[0]  # [S, H]
    scores = model.score(hidden[at]).squeeze(-1).float()
    return torch.where(here, scores, 0.0)


def one_label(recipe: Recipe) -> Recipe:
    """``recipe`` with ``num_labels: 1`` in its model config (inline mapping or overrides); another count set there
    is a `PreflightError`."""
    model = recipe.model
    if isinstance(model.config, dict):
        found = model.config.get("num_labels", 1)
        config, overrides = {**model.config, "num_labels": 1}, model.config_overrides
    else:
        found = model.config_overrides.get("num_labels", 1)
        config, overrides = model.config, {**model.config_overrides, "num_labels": 1}
    if found != 1:
        raise PreflightError(f"model.task=reward scores with one label; num_labels is {found}")
    return attrs.evolve(recipe, model=attrs.evolve(model, config=config, config_overrides=overrides))


def checkpoint_keys(weights: str) -> set[str]:
    """The tensor names of a safetensors checkpoint (file, index or directory), headers only."""
    from safetensors import safe_open

    from veomni.models.loading.safetensors_io import resolve_checkpoint

    _, files, _ = resolve_checkpoint(weights)
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def check_reward_recipe(recipe: Recipe) -> None:
    """What reward-model training refuses before anything is built."""
    problems = []
    if recipe.model.backend == "hf":
        problems.append("model.backend veomni (packed pairs need veomni's attention), found hf")
    if recipe.data.kind != "preference" and not recipe.data.sources:
        problems.append(f"data.kind preference (chosen/rejected pairs), found {recipe.data.kind!r}")
    dataset = recipe.data.dataset
    if dataset is not None and dataset.get("streaming"):
        problems.append("an indexed dataset (pairs are packed from the index), found a streaming data.dataset")
    if recipe.lora.enabled:
        problems.append("lora.enabled false (the reward head is new and trained in full), found true")
    if problems:
        raise PreflightError("model.task=reward needs " + "; ".join(problems))


__all__ = ["HEAD", "METRICS", "RewardTask", "check_reward_recipe", "checkpoint_keys", "one_label"]
