"""The ``dpo:`` recipe section: preference optimisation on chosen/rejected pairs (``model.task: dpo``,
`veomni.train.tasks.preference`)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from veomni.train.recipe.parse import RecipeError

REFERENCE_FREE = ("simpo", "orpo")
"""Losses that score the policy alone: no reference model is built."""


def _field(default: Any, help: str) -> Any:
    return attrs.field(default=default, metadata={"help": help, "path": False})


@attrs.frozen(kw_only=True)
class DpoSection:
    loss: Literal["sigmoid", "ipo", "hinge", "sigmoid_norm", "simpo", "orpo"] = _field(
        "sigmoid",
        "the pair loss (each equal to TRL's): sigmoid (DPO), ipo (IPO, log-ratios averaged over the answer's tokens), "
        "hinge (SLiC), sigmoid_norm (DPO on length-normalised log-ratios), simpo (SimPO: reference-free, average "
        "log-probs, margin dpo.gamma), orpo (ORPO: chosen NLL minus beta * log-sigmoid of the log-odds ratio); the "
        "reference of the others is the model.weights model, frozen (with LoRA: the base, adapters off)",
    )
    beta: float = _field(
        0.1, "the inverse temperature of the implicit reward (ORPO: the weight of its odds term)"
    )
    gamma: float = _field(0.5, "SimPO's target reward margin (dpo.loss simpo only)")
    sft_weight: float = _field(
        0.0,
        "adds this weight times the chosen answers' token-mean NLL (DPO + SFT, CPO's alpha); ORPO's NLL term is part "
        "of its loss",
    )

    def __attrs_post_init__(self) -> None:
        if not self.beta > 0:
            raise RecipeError(f"dpo.beta: expected > 0, found {self.beta}")
        if self.sft_weight < 0:
            raise RecipeError(f"dpo.sft_weight: expected >= 0, found {self.sft_weight}")
        if self.gamma != 0.5 and self.loss != "simpo":
            raise RecipeError(f"dpo.gamma is SimPO's margin, but dpo.loss is {self.loss!r}; remove it")
        if self.sft_weight and self.loss == "orpo":
            raise RecipeError("dpo.sft_weight: ORPO's loss holds its NLL term already; remove dpo.sft_weight")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a reference model."""
        return self.loss not in REFERENCE_FREE
