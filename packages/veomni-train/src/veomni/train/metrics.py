"""Training FLOPs, MFU, the one console line per logging interval, and the optional TensorBoard / wandb sinks.

MFU convention (the causal one; it counts only useful work):

    step_flops = 6 * N_active * tokens + 6 * L * (H_q * D) * sum_i s_i**2     (sliding layers: `attention_flops`)
    MFU        = step_flops / (step_seconds * world_size * peak_flops_per_device)

``N_active`` counts the weights that multiply activations (every Linear / fused expert / LM-head weight; the
embedding lookup is not a matmul, unless tied to the LM head), with routed experts scaled by ``top_k / E``.
``6`` is forward, input gradient and weight gradient of a trained weight. A frozen weight does no weight gradient:
it counts 4 when a trained parameter runs before it (the input gradient must flow through it), else 2 (forward
only: a frozen vision tower, the frozen first layers); `matmul_flops_per_token` takes the order in which modules
register their parameters for the order in which they run, as transformers' models define them.
The attention term: per layer, per head and per sample of length ``s``, causal QK^T and PV cost ``2 * s**2 * D``
forward (half of the full ``4 * s**2 * D``), and training triples the forward. Packed samples only attend
inside themselves, so the sum runs over the samples, not the packed row. A hybrid's linear-attention layers
(Gated DeltaNet) add their recurrence's chunked matmuls per token, also x3 (`veomni.train.tasks`). Recomputation
from activation checkpointing is not useful work and is not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import attrs
import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

# Dense bf16 peak (no sparsity), per device, by a substring of torch.cuda.get_device_name(); the first match wins,
# so a variant ("H100 PCIe": lower clocks and power than the SXM part) comes before its family's name.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989.4e12,
    "H100 PCIe": 756.5e12,
    "H100 NVL": 835.5e12,
    "H100": 989.4e12,
    "H800 PCIe": 756.5e12,
    "H800": 989.4e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPU, unlisted GPUs): MFU is then not reported."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name: str) -> float | None:
    """The dense bf16 peak of the device called ``name`` (as ``torch.cuda.get_device_name`` says), or None."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def _matmul_elements(
    model: nn.Module, expert_param_names: Iterable[str], expert_fraction: float
) -> Iterator[tuple[str, nn.Parameter, float]]:
    """Every parameter of ``model`` in registration order, with its elements that multiply activations per token:
    0 for biases (fused per-expert ``[E, out]`` biases included: additions), norms and an untied embedding lookup
    (when tied, the tensor counts once, as the LM head's matmul); routed experts scaled by ``expert_fraction``."""
    experts = set(expert_param_names)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embedding is not None and head is not None and embedding.weight is head.weight
    for name, param in model.named_parameters():
        lookup = embedding is not None and param is embedding.weight and not tied
        if param.dim() < 2 or name.endswith("bias") or lookup:
            yield name, param, 0.0
        else:
            yield name, param, param.numel() * (expert_fraction if name in experts else 1.0)


def active_matmul_params(
    model: nn.Module, expert_param_names: Iterable[str] = (), expert_fraction: float = 1.0
) -> int:
    """Weights multiplying activations per token (see the module docstring).

    Args:
        model: an unsharded (meta is fine) HF causal LM.
        expert_param_names: FQNs of fused routed-expert tensors ``[E, ...]``.
        expert_fraction: ``top_k / E`` for those tensors.
    """
    return int(sum(n for _, _, n in _matmul_elements(model, expert_param_names, expert_fraction)))


def matmul_flops_per_token(
    model: nn.Module, expert_param_names: Iterable[str] = (), expert_fraction: float = 1.0,
    counted: Callable[[str], bool] = lambda name: True,
) -> float:  # fmt: skip
    """Training matmul FLOPs per token of ``model``'s weights (see the module docstring): 6 per trained weight
    element, 4 per frozen one that a trained parameter runs before, 2 per frozen one before any trained parameter.

    Args:
        model: an unsharded (meta is fine) HF model, with ``requires_grad`` as it will train.
        expert_param_names: FQNs of fused routed-expert tensors ``[E, ...]``.
        expert_fraction: ``top_k / E`` for those tensors.
        counted: which parameter names to count (every parameter still decides what runs before what).
    """
    total, trained_before = 0.0, False
    for name, param, elements in _matmul_elements(model, expert_param_names, expert_fraction):
        passes = 6.0 if param.requires_grad else (4.0 if trained_before else 2.0)
        trained_before = trained_before or param.requires_grad
        if counted(name):
            total += passes * elements
    return total


def attention_flops(
    sample_lengths: Iterable[int], num_layers: int, query_width: float, window: int | None = None
) -> float:
    """Causal attention training FLOPs of packed samples: ``6 * L * (H_q * D) * sum(s_i ** 2)``.

    With a sliding ``window`` w (each query sees at most w keys) a sample longer than w costs ``w * (2 s - w)``
    instead of ``s ** 2``: the causal triangle up to w, then w keys for each later query.
    """
    pairs = sum(s * s if window is None or s <= window else window * (2 * s - window) for s in sample_lengths)
    return 6.0 * num_layers * query_width * float(pairs)


@attrs.frozen(kw_only=True)
class StepMetrics:
    """What one logging interval reports (averages over its steps; memory is the interval's peak allocated memory,
    the largest of any rank)."""

    step: int
    total_steps: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s_per_device: float
    mfu: float | None
    peak_memory_gib: float | None
    data_wait_fraction: float
    skipped: int = 0
    elapsed_s: float | None = None
    eta_s: float | None = None
    moe_imbalance: float | None = None  # the largest max/mean expert load of any MoE layer (veomni.models.moe.expert_load)
    source_losses: dict[str, float] | None = None  # a mixture's mean loss per source (shown with log.source_losses)
    task_metrics: dict[str, float] | None = None  # the task's own means (dpo: rewards), shown by short name


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: short enough for a log line, exact enough to plan by."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def console_line(m: StepMetrics) -> str:
    """``step 10/100 | loss 2.3456 | grad 1.234 | lr 3.00e-04 | tok/s/dev 12,345 | mfu 41.2% | mem 3.1 GiB | data 1.2%
    | elapsed 1m05s | eta 9m45s`` (elapsed and ETA where the loop gives them)."""
    parts = [
        f"step {m.step}/{m.total_steps}",
        f"loss {m.loss:.4f}",
        f"grad {m.grad_norm:.3f}",
        f"lr {m.lr:.2e}",
        f"tok/s/dev {m.tokens_per_s_per_device:,.0f}",
        f"mfu {m.mfu * 100:.1f}%" if m.mfu is not None else "mfu n/a",
        f"mem {m.peak_memory_gib:.1f} GiB" if m.peak_memory_gib is not None else "mem n/a",
        f"data {m.data_wait_fraction * 100:.1f}%",
    ]
    if m.moe_imbalance is not None:
        parts.append(f"moe max/mean {m.moe_imbalance:.2f}")
    if m.source_losses:
        parts.append(" ".join(f"{name} {loss:.4f}" for name, loss in m.source_losses.items()))
    if m.task_metrics:
        parts.append(
            " ".join(f"{name.rsplit('/', 1)[-1]} {value:.4g}" for name, value in m.task_metrics.items())
        )
    if m.elapsed_s is not None:
        parts.append(f"elapsed {format_duration(m.elapsed_s)}")
    if m.eta_s is not None:
        parts.append(f"eta {format_duration(m.eta_s)}")
    if m.skipped:
        parts.append(f"skipped {m.skipped} (no trained token or fp16 overflow)")
    return " | ".join(parts)


def window_peak_memory_gib(device: torch.device) -> float | None:
    """The largest peak of allocated accelerator memory on any rank since the previous call, in GiB (None on CPU);
    then the peak restarts. A collective over the world when it has several ranks: every rank calls it, once per
    log window (EP and uneven rows make ranks differ; rank 0's own peak could hide the one that runs out)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


class Sinks:
    """TensorBoard and/or wandb, created on rank 0 only when configured; a configured sink that cannot be
    imported is an error naming the extra to install, never silently skipped."""

    def __init__(
        self, *, tensorboard_dir: str | None, wandb_project: str | None, run_name: str, config: dict
    ):
        self._tb = None
        self._wandb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("log.tensorboard_dir is set but tensorboard is not installed: "
                                  "install veomni-train[tensorboard]") from err  # fmt: skip
            self._tb = SummaryWriter(tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("log.wandb_project is set but wandb is not installed: "
                                  "install veomni-train[wandb]") from err  # fmt: skip
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config)

    def write(self, step: int, values: dict[str, float]) -> None:
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
