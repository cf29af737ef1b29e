"""Non-finite numbers in training: dynamic loss scaling for fp16 compute, and the divergence check.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero in its backward, and values above 65,504 overflow.
With ``model.dtype: float16`` the backward runs on ``loss x S`` (`DynamicLossScale.scale`, a 0-d fp32 device tensor
that captured CUDA graphs read at replay), lifting small gradients into range. The gradients (fp32: FSDP2 reduces
them in fp32, the one-rank path accumulates them into fp32 masters) are divided by ``S`` again before clipping. A
step whose global gradient norm is inf or nan overflowed: it is skipped (no optimizer, schedule or router-bias
step; the gradients are dropped) and ``S`` halves. After ``growth_interval`` finite steps in a row ``S`` doubles.
The decision needs the norm on the host, one sync per step, on this path only. ``S`` and the count of finite steps
are checkpointed, so a resumed run scales as the uninterrupted one would.

Without loss scaling (bf16, fp32) a non-finite loss or gradient norm is not a recoverable event: clipping cannot
repair it, and AdamW writes the nan into every weight. `check_finite` stops the run with `TrainingDivergedError`
when the trainer reads a step's numbers, which it always does before a checkpoint is written, so no diverged state
is saved and keep-last pruning never removes a good checkpoint for a diverged one. The optimizer has applied the
step's update by then (the numbers are read after the step, without a host sync): the message says whether the
weights in memory turned non-finite (`local_weights_finite`), as an inf gradient norm clipped to zero can leave them
finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

FP16_INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000  # finite steps in a row before the scale doubles (torch.amp.GradScaler's default)


class TrainingDivergedError(RuntimeError):
    """A trained step produced a non-finite loss or gradient norm (nan or inf) without loss scaling to absorb it."""


class DynamicLossScale:
    """The loss scale ``S`` of fp16 training and its update rule (halve on overflow, double after
    ``growth_interval`` finite steps in a row).

    Args:
        device: where ``scale`` lives (the training device).
        init_scale: the first ``S``, a power of two so that scaling and unscaling are exact.
        growth_interval: finite steps in a row before ``S`` doubles.
    """

    def __init__(
        self,
        device: torch.device,
        init_scale: float = FP16_INIT_SCALE,
        growth_interval: int = GROWTH_INTERVAL,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0) or growth_interval < 1:
            raise ValueError(
                f"DynamicLossScale: expected a finite init_scale > 0 and growth_interval >= 1, found {init_scale} "
                f"and {growth_interval}"
            )
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_interval = growth_interval
        self.finite_steps = 0  # finite steps since the last change of the scale
        self._value = init_scale  # host copy: updates never read the device

    @property
    def value(self) -> float:
        """``S`` as a host float."""
        return self._value

    def update(self, finite: bool) -> None:
        """Adjust ``S`` after a step whose gradients were ``finite`` (stepped) or not (skipped).

        Raises:
            TrainingDivergedError: the gradients stay non-finite with ``S`` already below 1, i.e. without any
                scaling: the forward itself produces inf or nan, which a smaller scale cannot repair.
        """
        if finite:
            self.finite_steps += 1
            if self.finite_steps == self.growth_interval:
                self._set(self._value * 2.0)
            return
        if self._value < 1.0:
            raise TrainingDivergedError(
                f"fp16 gradients are non-finite even at loss scale {self._value:g}: the forward or the loss "
                "overflows fp16 (inf/nan), which loss scaling cannot repair; train in bfloat16 (or float32), or "
                "lower the learning rate"
            )
        self._set(self._value * 0.5)

    def _set(self, value: float) -> None:
        self._value = value
        self.scale.fill_(value)  # in place: captured CUDA graphs hold this tensor
        self.finite_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"scale": float, "finite_steps": int}``: what a resumed run needs to scale as this one would."""
        return {"scale": self._value, "finite_steps": self.finite_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s values."""
        self._set(float(state["scale"]))
        self.finite_steps = int(state["finite_steps"])


def local_weights_finite(module: torch.nn.Module) -> bool:
    """Whether this rank's part of ``module``'s parameters (a DTensor's local shard) is all finite. Rank-local, no
    collective: it runs on an error path that ranks may reach at different times."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return all(
            bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
            for p in module.parameters()
        )


def check_finite(
    step: int,
    stats: Mapping[str, float],
    last_checkpoint: str | None,
    *,
    weights_finite: bool | None = None,
    last_step: int | None = None,
) -> None:
    """Raise unless a trained step's ``loss`` and ``grad_norm`` (host floats) are finite.

    Args:
        step: the step's number (1-based, as logged).
        stats: the step's numbers as `veomni.train.step.read_stats` returns them.
        last_checkpoint: the newest complete checkpoint, named in the message (None: there is none).
        weights_finite: whether the weights in memory were found finite after the update (`local_weights_finite`;
            None: not checked); the message says what was found, never more.
        last_step: the newest step run when the numbers were read (steps run ahead of the read, without a host
            sync); named when it is past ``step``.

    Raises:
        TrainingDivergedError: naming the step, the values, the state of the weights and where to resume from.
    """
    loss, grad_norm = stats["loss"], stats["grad_norm"]
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    where = (
        f"the newest checkpoint, {last_checkpoint}, is from before it" if last_checkpoint else "no checkpoint"
    )
    ahead = f" (and those of steps {step + 1}..{last_step}, run before its numbers were read)"
    applied = "The optimizer applied its update" + (
        ahead if last_step is not None and last_step > step else ""
    )
    if weights_finite is None:
        state = f"{applied}; the weights in memory were not checked"
    elif weights_finite:
        state = (
            f"{applied}; the weights in memory are still finite, but come from a step with non-finite numbers"
        )
    else:
        state = f"{applied}, and the weights in memory now hold non-finite values"
    raise TrainingDivergedError(
        f"step {step} diverged: loss {loss}, gradient norm {grad_norm}. {state}. The run stops here and saves "
        f"nothing more ({where}). Resume from a checkpoint with a lower --optim.lr and "
        "--optim.on_resume=recipe (without it a resume keeps the saved lr), a longer warmup or a lower "
        "optim.max_grad_norm, or look for bad data at this step (veomni-data-preview)"
    )
