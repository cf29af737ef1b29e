"""A user's own training task, run from a recipe without editing veomni (docs/guides/add-a-data-format-or-task.md).

`BitsTextTask` trains exactly as ``model.task: text`` does -- same inputs, same objective, same gradients -- but
reports the loss in bits per token instead of nats, the unit compression papers quote. A recipe selects it by
import path, with this folder on ``PYTHONPATH``::

    PYTHONPATH=examples/custom_task uv run veomni-train quickstart --model.task=bits_task:BitsTextTask

The `register_task` decorator also makes it available by name (``model.task: text_bits``) wherever this module is
imported, or declared as an entry point in the ``veomni.tasks`` group of the user's package.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
import torch

from veomni.train.tasks import register_task
from veomni.train.tasks.text import TextTask


@register_task("text_bits")
@attrs.frozen(kw_only=True)
class BitsTextTask(TextTask):
    """Causal language modelling whose reported loss is in bits per token (the objective stays in nats)."""

    name: ClassVar[str] = "text_bits"

    def loss(self, outputs: Any, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reported, objective)``: the text task's pair with the reported 0-d loss divided by ln 2."""
        reported, objective = super().loss(outputs, aux_scale)
        return reported / math.log(2.0), objective
