"""Preference optimisation on chosen/rejected pairs (``model.task: dpo``; the loss in ``dpo.loss``).

Each pair is one packed sample of two segments (`veomni.train.data.pairs`): segment ``2i`` holds pair i's chosen
answer, ``2i + 1`` its rejected one. The policy's forward hands back per-token log-probabilities instead of a loss
(`veomni.models.heads.causal_lm.capture_token_log_probs`: the ``log_probs`` kernel, never ``[T, V]``), which are
summed per segment; under Ulysses SP each rank holds a slice of the row, so the per-segment sums are all-reduced
over the SP group (an autograd-aware all-reduce: its backward sums the SP ranks' gradients, so each rank's share of
``loss / sp`` back-propagates the whole pair loss into its own tokens).

The reference log-probabilities come from the ``model.weights`` model, frozen and sharded like the policy (built
in the compute dtype, no optimizer state), or -- with LoRA -- from the policy itself with its adapters off
(`veomni.models.lora.disabled_adapters`); SimPO and ORPO need none.

Normalisation (`step_normaliser`): a step's pair losses are divided by its number of pairs over all DP ranks, and
the NLL terms (ORPO's, ``dpo.sft_weight``'s) by its chosen-answer tokens, both counted on the host and summed over
the ranks once per step; the sum of every rank's objective is then the step's loss, veomni's convention
(`veomni.core.loss`). The per-pair formulas are TRL's (``DPOTrainer``, ``CPOTrainer`` for SimPO, ``ORPOTrainer``);
tests/train/test_dpo_trl.py holds them equal on the same tokens, gradients included.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from veomni.core.parallel_state import ParallelState
from veomni.train.data import Step
from veomni.train.data.packing import IGNORE_INDEX
from veomni.train.preflight import PreflightError
from veomni.train.recipe.dpo_section import DpoSection
from veomni.train.tasks import TaskSetup
from veomni.train.tasks.text import TextTask, prepare_transformers_task

if TYPE_CHECKING:
    from veomni.train.loop import Run
    from veomni.train.recipe import Recipe

log = logging.getLogger("veomni.train")

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margin",
    "rewards/accuracy",
    "logps/chosen",
    "logps/rejected",
)
"""Per-step means over the step's pairs, beside the loss (TRL's names)."""


@attrs.frozen
class PairLayout:
    """Host-side layout of one micro-batch's pairs on this rank.

    Attributes:
        segment: int64 ``[S]``: each local position's segment (``2 * pairs`` for the SP padding).
        valid: bool ``[pairs]``: False for a bad row's stand-in (``data.on_bad_row: skip``).
        chosen_tokens: trained positions of the valid pairs' chosen answers on this rank.
        chosen_positions: positions with a next token in the valid pairs' chosen segments (prompt included: ORPO's
            NLL, as TRL scores it) on this rank.
    """

    segment: torch.Tensor
    valid: torch.Tensor
    chosen_tokens: int
    chosen_positions: int

    @property
    def pairs(self) -> int:
        return int(self.valid.numel())


def pair_layout(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> PairLayout:
    """The `PairLayout` of a packed micro-batch (`veomni.train.data.packing.collate` of pair samples), computed
    once and kept in the batch."""
    if "pair_layout" in batch:
        return batch["pair_layout"]  # type: ignore[no-any-return]
    if batch.get("is_padding"):  # evaluation's filler batch (a rank with fewer batches than its peers): no pair
        return PairLayout(torch.zeros(batch["input_ids"].shape[1], dtype=torch.int64), torch.zeros(0, dtype=torch.bool), 0, 0)
    cu = batch["cu_seqlens"].numpy().astype(np.int64)
    pairs = len(batch["sample_index"])
    local = batch["input_ids"].shape[1]
    positions = sp_rank * local + np.arange(local, dtype=np.int64)
    segment = np.minimum(np.searchsorted(cu[1:], positions, side="right"), 2 * pairs)
    real_segments = int(np.searchsorted(cu[1:], batch["seq_len"] - 1, side="right")) + 1
    if real_segments != 2 * pairs:
        raise ValueError(
            f"a preference micro-batch of {pairs} samples holds {real_segments} segments, not two per pair: "
            "model.task=dpo trains on data.kind=preference rows"
        )
    replaced = {row for row, _ in batch.get("replaced_rows", ())}
    valid = torch.tensor([row not in replaced for row in batch["sample_index"]], dtype=torch.bool)
    labels = batch["labels"][0].numpy()
    is_chosen = (segment % 2 == 0) & (segment < 2 * pairs)
    chosen_valid = is_chosen & np.asarray(valid.tolist() + [False], dtype=bool)[segment // 2]
    next_ids = batch["next_ids"][0].numpy()
    layout = PairLayout(
        torch.from_numpy(segment), valid, int(((labels != IGNORE_INDEX) & chosen_valid).sum()),
        int(((next_ids != IGNORE_INDEX) & chosen_valid).sum()),
    )  # fmt: skip
    if isinstance(batch, dict):
        batch["pair_layout"] = layout
    return layout


def sp_position(state: ParallelState | None) -> tuple[int, int]:
    """``(SP rank, SP degree)`` of this rank; ``(0, 1)`` without SP."""
    if state is None or not state.sp_enabled:
        return 0, 1
    return state.sp_rank, state.dims.sp


def pair_counts(step: Step, state: ParallelState | None, device: torch.device) -> torch.Tensor:
    """``[pairs, chosen answer tokens, chosen positions]`` of the whole step over every rank (`PairLayout`), int64
    on ``device`` (one all-reduce): the normalisers of the pair losses and of the NLL terms."""
    sp_rank, sp = sp_position(state)
    layouts = [pair_layout(batch, sp_rank, sp) for batch in step.micro_batches]
    # Every SP rank of a group holds the same pairs: counted once each (the SP ranks' counts are summed).
    pairs = sum(int(layout.valid.sum()) for layout in layouts) if sp_rank == 0 else 0
    counts = torch.tensor(
        [pairs, sum(lay.chosen_tokens for lay in layouts), sum(lay.chosen_positions for lay in layouts)],
        dtype=torch.int64,
    ).to(device)
    if state is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts, group=state.loss_group)
    return counts


@attrs.frozen
class PairOutputs:
    """What `DpoTask.forward` hands to `DpoTask.loss`: 0-d fp32 tensors, this rank's shares (module docstring)."""

    loss: torch.Tensor
    aux_loss: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


@attrs.frozen(kw_only=True)
class _Scored:
    """One micro-batch's pairs scored (`DpoTask._score`): fp32 device tensors, per-pair ``[pairs]`` ones."""

    layout: PairLayout
    labels: torch.Tensor
    next_ids: torch.Tensor
    segment: torch.Tensor
    token_logps: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor
    valid: torch.Tensor
    per_pair: torch.Tensor
    rewards: tuple[torch.Tensor, torch.Tensor]
    aux_loss: torch.Tensor | None


@attrs.define(kw_only=True)
class DpoTask:
    """Preference optimisation (module docstring).

    Attributes:
        text: the `TextTask` of the same model (FLOPs, export, tokenizer files).
        settings: the recipe's ``dpo`` section.
        state: the run's parallel state (SP rank, group and degree).
        reference: the frozen reference model (full fine-tuning with a reference loss), else None.
        lora_reference: the reference is the policy with its adapters off.
    """

    text: TextTask
    settings: DpoSection = attrs.field(factory=DpoSection)
    state: ParallelState | None = None
    reference: nn.Module | None = None
    lora_reference: bool = False
    _metrics: dict[str, torch.Tensor] = attrs.field(factory=dict)
    name: ClassVar[str] = "dpo"
    metric_names: ClassVar[tuple[str, ...]] = METRICS
    console_metrics: ClassVar[tuple[str, ...]] = ("rewards/margin", "rewards/accuracy")
    model_task: ClassVar[str] = "causal_lm"
    data_kinds: ClassVar[tuple[str, ...]] = ("preference",)

    @property
    def aux_loss_coef(self) -> float:
        return self.text.aux_loss_coef

    @classmethod
    def for_model(cls, probe: nn.Module) -> DpoTask:
        """The task for ``probe`` with default settings (`prepare` sets the recipe's)."""
        return cls(text=TextTask.for_model(probe))

    @classmethod
    def prepare(cls, recipe: Recipe, state: ParallelState, device: torch.device) -> TaskSetup:
        """`TaskSetup` of a transformers task, after the checks only preference training needs."""
        check_dpo_recipe(recipe)
        setup = prepare_transformers_task(cls, recipe, state, device)
        task = setup.task
        task.settings, task.state = recipe.dpo, state
        task.lora_reference = recipe.dpo.needs_reference and recipe.lora.enabled
        return setup

    def data_options(self) -> dict[str, Any]:
        return {}

    def attach(self, run: Run) -> None:
        """Build the frozen reference model once the policy exists (full fine-tuning with a reference loss): the
        recipe's model from ``model.weights`` in the compute dtype, sharded like the policy, never stepped."""
        if not self.settings.needs_reference or self.lora_reference:
            return
        from veomni.train.model_setup import build_recipe_model, hand_aux_loss_to_loop, meta_instance
        from veomni.train.recipe import LoraSection

        recipe = run.recipe
        frozen = attrs.evolve(
            recipe,
            model=attrs.evolve(recipe.model, param_dtype=recipe.model.dtype, freeze=()),
            parallel=attrs.evolve(recipe.parallel, activation_checkpointing=False),
            lora=LoraSection(),
        )
        probe = meta_instance(run.config, self.model_task)
        ops = recipe.ops.to_ops_config(hardware=_hardware(run.device))
        reference = build_recipe_model(frozen, run.config, probe, ops, run.state, run.device)
        reference.requires_grad_(False)
        reference.eval()
        hand_aux_loss_to_loop(reference)
        self.reference = reference
        log.info("dpo: reference model built from %s (frozen, %s)", recipe.model.weights, recipe.model.dtype)

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        kwargs = self.text.model_kwargs(batch, device, num_items)
        kwargs.pop("labels")  # a loss is not computed: the head hands back log-probabilities (shift_labels)
        kwargs.pop("num_items_in_batch")
        return kwargs

    def _score(self, model: nn.Module, batch: Mapping[str, Any], device: torch.device) -> _Scored:
        """Run the reference (when the loss has one) and the policy on one micro-batch and score its pairs."""
        from veomni.models.heads.causal_lm import capture_token_log_probs

        layout = pair_layout(batch, *self._sp())
        kwargs = self.model_kwargs(batch, device, torch.ones((), dtype=torch.int64))
        labels = kwargs["shift_labels"]  # the answers' targets
        # Every position's next token in its segment is scored (the kernel's cost is per position either way): the
        # answer sums keep the trained ones, ORPO's NLL all of the chosen segment's.
        next_ids = batch["next_ids"] if "next_ids" in batch else batch["labels"]  # (a filler batch has no pair)
        kwargs["shift_labels"] = next_ids = next_ids.to(device, non_blocking=True)
        segment = layout.segment.to(device, non_blocking=True)
        reference = None
        if self.settings.needs_reference:
            plain = {k: v for k, v in kwargs.items() if k != "output_router_logits"}
            with torch.no_grad(), capture_token_log_probs() as got:
                if self.lora_reference:
                    from veomni.models.lora import disabled_adapters

                    with disabled_adapters(model):
                        model(**plain)
                else:
                    assert self.reference is not None, "DpoTask.attach builds the reference model"
                    self.reference(**plain)
            reference = self._segment_sums(_one(got), labels, segment, layout.pairs)[0]
        with capture_token_log_probs() as got:
            outputs = model(**kwargs)
        token_logps = _one(got)
        sums, counts = self._segment_sums(token_logps, labels, segment, layout.pairs)
        valid = layout.valid.to(device, non_blocking=True)
        per_pair, rewards = self._pair_losses(sums, counts, reference, valid)
        return _Scored(
            layout=layout, labels=labels, next_ids=next_ids, segment=segment, token_logps=token_logps, sums=sums,
            counts=counts, valid=valid, per_pair=per_pair, rewards=rewards, aux_loss=getattr(outputs, "aux_loss", None),
        )  # fmt: skip

    def forward(
        self, model: nn.Module, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> PairOutputs:
        """The pair loss of one micro-batch; ``num_items``: `step_normaliser`'s counts."""
        scored = self._score(model, batch, device)
        valid, segment, layout = scored.valid, scored.segment, scored.layout
        weight = valid.float() / (num_items[0] * self._sp()[1])
        loss = (scored.per_pair * weight).sum()
        orpo = self.settings.loss == "orpo"
        nll_weight = 1.0 if orpo else self.settings.sft_weight
        if nll_weight:
            chosen = (segment % 2 == 0) & (segment < 2 * layout.pairs)
            chosen = chosen & torch.cat([valid, valid.new_zeros(1)])[segment // 2]
            # ORPO (TRL's): the whole chosen sequence, prompt included; DPO + SFT: the chosen answer's tokens.
            scored_tokens = (scored.next_ids if orpo else scored.labels).view(-1) != IGNORE_INDEX
            count = num_items[2] if orpo else num_items[1]
            nll = -(scored.token_logps.view(-1) * (chosen & scored_tokens)).sum() / count.clamp(min=1)
            loss = loss + nll_weight * nll
        chosen_logps, rejected_logps = self._answer_logps(scored.sums, scored.counts)
        chosen_reward, rejected_reward = scored.rewards
        self._metrics = {
            name: (value.detach() * weight).sum()
            for name, value in zip(METRICS, (
                chosen_reward, rejected_reward, chosen_reward - rejected_reward,
                (chosen_reward > rejected_reward).float(), chosen_logps, rejected_logps,
            ), strict=True)
        }  # fmt: skip
        return PairOutputs(loss=loss, aux_loss=scored.aux_loss, metrics=self._metrics)

    @torch.no_grad()
    def eval_sums(self, model: nn.Module, batch: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        """This rank's share of the evaluation sums of one batch, fp32 ``[4]``: pair loss, correctly ordered
        pairs, reward margin, pairs (each pair counted on one rank of its SP group); `eval_results` reads them."""
        scored = self._score(model, batch, device)
        chosen, rejected = scored.rewards
        valid = scored.valid.float() * (1.0 if self._sp()[0] == 0 else 0.0)
        return torch.stack([
            (scored.per_pair * valid).sum(), ((chosen > rejected).float() * valid).sum(),
            ((chosen - rejected) * valid).sum(), valid.sum(),
        ])  # fmt: skip

    def eval_results(self, totals: torch.Tensor) -> dict[str, float]:
        """``eval_loss`` (the mean pair loss; ORPO's and ``dpo.sft_weight``'s NLL terms left out) and the reward
        accuracy and margin over every evaluation pair, from `eval_sums` summed over batches and ranks."""
        loss, correct, margin, pairs = totals.tolist()
        if pairs == 0:
            raise ValueError("evaluation: data.eval_files hold no preference pair")
        return {"eval_loss": loss / pairs, "eval_rewards/accuracy": correct / pairs, "eval_rewards/margin": margin / pairs}

    def _sp(self) -> tuple[int, int]:
        return sp_position(self.state)

    def _segment_sums(
        self, token_logps: torch.Tensor, labels: torch.Tensor, segment: torch.Tensor, pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-segment ``(log-prob sums, trained-token counts)``, fp32 ``[2 * pairs]`` each, over the whole row
        (summed over the SP group)."""
        trained = (labels.view(-1) != IGNORE_INDEX).float()
        sums = token_logps.new_zeros(2 * pairs + 1).index_add(0, segment, token_logps.view(-1) * trained)
        counts = trained.new_zeros(2 * pairs + 1).index_add(0, segment, trained)
        if self._sp()[1] > 1:
            assert self.state is not None
            sums = differentiable_all_reduce(sums, group=self.state.sp_group)
            with torch.no_grad():
                dist.all_reduce(counts, group=self.state.sp_group)
        return sums[:-1], counts[:-1]

    def _answer_logps(self, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's chosen and rejected log-probabilities as the loss scores them: summed over the answer's
        tokens, or averaged over them (SimPO, ORPO)."""
        if self.settings.loss in ("simpo", "orpo"):
            sums = sums / counts.clamp(min=1)
        return sums[0::2], sums[1::2]

    def _pair_losses(
        self, sums: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None, valid: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``(per-pair loss [pairs], (chosen reward, rejected reward))``, TRL's formulas (module docstring); a
        bad row's stand-in (not ``valid``, no trained token) scores as log-probabilities of -1, weighted 0 later."""
        s, beta = self.settings, self.settings.beta
        chosen, rejected = self._answer_logps(sums, counts)
        # Its average log-probability would be 0/1 = 0, where ORPO's log(1 - p) is -inf (and 0 * inf is NaN).
        chosen, rejected = torch.where(valid, chosen, -1.0), torch.where(valid, rejected, -1.0)
        if reference is None:  # SimPO and ORPO: rewards are beta times the average log-probabilities
            rewards = (beta * chosen.detach(), beta * rejected.detach())
            if s.loss == "simpo":
                return -F.logsigmoid(beta * (chosen - rejected) - s.gamma), rewards
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            return -beta * F.logsigmoid(log_odds), rewards
        chosen_ratio, rejected_ratio = chosen - reference[0::2], rejected - reference[1::2]
        rewards = (beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
        if s.loss in ("ipo", "sigmoid_norm"):
            delta = chosen_ratio / counts[0::2].clamp(min=1) - rejected_ratio / counts[1::2].clamp(min=1)
            if s.loss == "ipo":
                return (delta - 1 / (2 * beta)) ** 2, rewards
            return -F.logsigmoid(beta * delta), rewards
        delta = chosen_ratio - rejected_ratio
        if s.loss == "hinge":
            return torch.relu(1 - beta * delta), rewards
        return -F.logsigmoid(beta * delta), rewards

    def step_normaliser(self, step: Step, device: torch.device) -> torch.Tensor:
        """`pair_counts` of the step."""
        return pair_counts(step, self.state, device)

    def trained_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return self.text.trained_tokens(batch)

    def loss(self, outputs: PairOutputs, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        loss = outputs.loss
        if self.aux_loss_coef and outputs.aux_loss is not None:
            return loss, loss + self.aux_loss_coef * aux_scale * outputs.aux_loss
        return loss, loss

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The metric shares of the micro-batch just run, 0-d fp32 (`veomni.train.step` sums them over the step's
        micro-batches and all ranks, which gives means over the step's pairs)."""
        return self._metrics

    def export(self, model: nn.Module, out: Path, tokenizer: Any, parallel_state: ParallelState) -> None:
        self.text.export(model, out, tokenizer, parallel_state)

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        self.text.checkpoint_files(model, out, tokenizer)

    def step_flops(self, step: Step) -> float:
        # The policy's forward and backward, plus the reference's forward (a third of a training step's FLOPs).
        train = self.text.step_flops(step)
        return train * (4 / 3) if self.settings.needs_reference else train


def _one(captured: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    if len(captured) != 1:
        raise PreflightError(
            f"model.task=dpo reads per-token log-probabilities from veomni's LM head, but the forward handed back "
            f"{len(captured)} (model.backend must be veomni, not hf)"
        )
    return captured[0][0]


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _hardware(device: torch.device) -> Any:
    from veomni.train.model_setup import _hardware as hardware

    return hardware(device)


def check_dpo_recipe(recipe: Recipe) -> None:
    """What preference training refuses before anything is built, each with its reason."""
    problems = []
    if recipe.model.backend == "hf":
        problems.append(
            "model.backend veomni (the per-token log-probabilities come from veomni's LM head), found hf"
        )
    dataset = recipe.data.dataset
    if dataset is not None and dataset.get("streaming"):
        problems.append(
            "an indexed dataset (pairs are packed from the index), found a streaming data.dataset"
        )
    if recipe.data.kind != "preference" and not recipe.data.sources:
        problems.append(f"data.kind preference (chosen/rejected pairs), found {recipe.data.kind!r}")
    reference = recipe.dpo.needs_reference
    if reference and not recipe.lora.enabled and recipe.model.weights is None:
        problems.append(
            f"model.weights for dpo.loss {recipe.dpo.loss!r} (its reference model is the starting checkpoint; a "
            "model initialised at random has none), found none; or pick a reference-free loss (simpo, orpo)"
        )
    if reference and recipe.lora.enabled and recipe.lora.modules_to_save:
        problems.append(
            "no lora.modules_to_save (the reference is the base with the adapters off, and fully trained modules "
            f"cannot be switched off), found {list(recipe.lora.modules_to_save)}"
        )
    if problems:
        raise PreflightError("model.task=dpo needs " + "; ".join(problems))


__all__ = [
    "METRICS", "DpoTask", "PairLayout", "PairOutputs", "check_dpo_recipe", "pair_counts", "pair_layout", "sp_position",
]
