"""The contenders of `bench_e2e.py`: one model + optimizer setup each, behind a common `step` interface.

veomni (the trainer's default: on one rank a plain bf16 module over fp32 master weights the optimizer steps,
`veomni.core.master_weights`, or FSDP2 on a one-rank mesh with ``veomni_fsdp2``; fp32 masters either way),
veomni_plain (no FSDP2, parameters in the compute dtype: the
trainer's one-rank path when ``model.param_dtype`` equals ``model.dtype``), each eager (``ops.compile="off"``)
and with compiled decoder blocks (``*_compiled``: ``ops.compile="on"``, `veomni.core.compile.compile_blocks`
inside `build_model`), HF with SDPA, and HF + Liger. Each ``step`` runs one optimizer step;
`bench_e2e.run_contender` times it.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.compile import CompileStats, compile_stats
from veomni.core.fsdp import set_grad_sync
from veomni.core.master_weights import apply_master_weights, master_weights_of
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import OpsConfig
from veomni.kernels.hardware import Hardware, detect_hardware
from veomni.models.build import build_model, default_fsdp_policy
from veomni.models.registry import MODELS
from veomni.train.cuda_graphs import MicroBatchGraphs, static_packing
from veomni.train.data import model_inputs
from veomni.train.optim import build_adamw, clip_and_step, param_groups

# ---------------------------------------------------------------- contenders


@attrs.define
class Settings:
    """What every contender shares (from the command line)."""

    device: torch.device
    weights: str
    lr: float
    weight_decay: float
    max_grad_norm: float
    precision: str  # "bf16": bf16 compute over fp32 master weights; "fp32": fp32 throughout
    ac: str  # "none", "veomni" or "all"
    hf_master: str  # "fp32" (autocast) or "bf16" (pure bf16 parameters and optimizer state)
    veomni_ops: dict[str, str]
    veomni_reshard: bool = (
        True  # FSDP2 reshard_after_forward (on one GPU, False skips the backward re-gather)
    )
    # veomni/veomni_compiled on one rank: FSDP2 on a one-rank mesh (the trainer's parallel.force_fsdp2) instead of
    # the trainer's default plain module (bf16 over fp32 master weights; fp32: plain fp32).
    veomni_fsdp2: bool = False
    profile_dir: str | None = None  # write a torch.profiler table of 2 extra steps per contender
    task: str = "causal_lm"  # the registry task: "causal_lm" (bench_e2e) or "image_text_to_text" (bench_vlm)


# HF's auto class per registry task, and the Liger patch of each model type (with the kernels it can patch).
HF_AUTO = {"causal_lm": AutoModelForCausalLM, "image_text_to_text": AutoModelForImageTextToText}
LIGER_PATCHES = {
    "qwen3": ("apply_liger_kernel_to_qwen3", {"rope": True, "rms_norm": True, "swiglu": True}),
    # Liger 0.8.5 has no SwiGLU patch for Qwen3-VL's text MLP.
    "qwen3_vl": ("apply_liger_kernel_to_qwen3_vl", {"rope": True, "rms_norm": True}),
    "qwen2_5_vl": ("apply_liger_kernel_to_qwen2_5_vl", {"rope": True, "rms_norm": True, "swiglu": True}),
}
# Liger's VL fused-linear-CE forwards read ``outputs.rope_deltas``, which transformers 5.23 no longer returns: for
# these the fused linear CE runs through `_liger_vl_forward` instead.
LIGER_LCE_BY_HAND = ("qwen3_vl", "qwen2_5_vl")
# Batch keys a vision-language forward takes besides the packed text inputs (None when the micro-batch has none).
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def vision_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The vision tensors of ``batch`` (empty for a text batch)."""
    return {k: batch[k] for k in VISION_KEYS if k in batch}


def veomni_vision_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """`vision_inputs` plus the collator's ``vision_metadata`` (the tower's window layout), which veomni's models
    take precomputed as the trainer gives it; HF's compute theirs in the forward."""
    extra = {"vision_metadata": batch["vision_metadata"]} if batch.get("vision_metadata") is not None else {}
    return {**vision_inputs(batch), **extra}


class Contender:
    """A model and its optimizer. ``info`` describes the setup for the JSON.

    ``step(micro_batches, num_items)`` runs one optimizer step over the micro-batches (dicts of
    `packed_batches`, on the device) with ``num_items`` (fp32 0-d) the step's valid-label count, and returns
    ``(loss, grad_norm)`` as 0-d fp32 tensors: the token-mean loss before the update and the norm before clipping.
    """

    info: dict[str, Any]
    # The shared counting backend of the compiled blocks (None: nothing compiled).
    compile_stats: CompileStats | None = None

    def step(
        self, micro_batches: Sequence[dict[str, Any]], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def _ops(s: Settings, compile_setting: str) -> OpsConfig:
    # OpsConfig validates against the device we run on, not whatever CUDA the process could see.
    hw = detect_hardware()
    if s.device.type == "cpu":
        hw = Hardware(device_type="cpu", triton_interpret=hw.triton_interpret)
    return OpsConfig(**s.veomni_ops, compile=compile_setting, hardware=hw)


def _ops_info(model: torch.nn.Module) -> dict[str, str]:
    # What build_model bound, not what was asked for: it adapts defaulted fields (fp32 compute, compiled blocks).
    ops = model.veomni_kernels.config
    return {
        name: getattr(ops, name)
        for name in ("attention", "cross_entropy", "rms_norm", "rope", "swiglu", "compile")
    }


class Veomni(Contender):
    """What veomni-train runs (`veomni.train.loop.one_rank_path`): on one rank a plain module -- bf16 over fp32
    master weights for ``--precision bf16`` (`veomni.core.master_weights`), fp32 for ``fp32`` -- or, on several
    ranks or with ``veomni_fsdp2``, FSDP2 with mixed precision; OpsConfig defaults for the device, veomni's AdamW
    and clip; decoder blocks compiled when ``compile_setting`` is ``"on"``."""

    def __init__(self, s: Settings, compile_setting: str = "off", cuda_graphs: bool = False) -> None:
        self.s = s
        self.state = build_parallel_state(ParallelDims.for_world(dist.get_world_size()), s.device.type)
        # FSDP blocks come from the class veomni builds; a meta instance costs nothing.
        config = MODELS.load_config(s.weights)
        with torch.device("meta"):
            probe = MODELS.model_class(config, s.task).cls._from_config(config)
        bf16 = s.precision == "bf16"
        policy = attrs.evolve(
            default_fsdp_policy(probe),
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32,
            activation_checkpointing=s.ac in ("veomni", "all"),
            reshard_after_forward=s.veomni_reshard,
        )
        ops = _ops(s, compile_setting)
        self.fsdp = self.state.dims.world_size > 1 or s.veomni_fsdp2
        if self.fsdp:
            self.model = build_model(
                s.weights,
                weights=s.weights,
                ops=ops,
                parallel_state=self.state,
                fsdp_policy=policy,
                task=s.task,
            )
            precision = (
                "FSDP2 on a 1-rank mesh: fp32 master parameters, bf16 compute (param_dtype), fp32 gradient reduce"
                if bf16 else "FSDP2 on a 1-rank mesh, fp32 throughout"
            )  # fmt: skip
        else:
            self.model = build_model(
                s.weights, weights=s.weights, ops=ops, device=s.device, task=s.task,
                compute_dtype=torch.bfloat16 if bf16 else None,
            )  # fmt: skip
            if bf16:
                apply_master_weights(self.model, torch.bfloat16, policy.block_patterns)
            if policy.activation_checkpointing:
                apply_activation_checkpointing(self.model, policy.block_patterns)
            precision = (
                "no FSDP (one rank): bf16 parameters over fp32 master weights the optimizer steps, gradients "
                "accumulated in fp32 (veomni.core.master_weights)"
                if bf16 else "no FSDP (one rank), fp32 throughout"
            )  # fmt: skip
        self.masters = master_weights_of(self.model)
        self.trained = self.model if self.masters is None else self.masters.module
        self.compile_stats = compile_stats(self.model)
        self.model.train()
        self.optimizer = build_adamw(
            self.trained, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=s.weight_decay
        )
        if cuda_graphs and self.fsdp:
            raise ValueError("cuda_graphs: the one-rank path only (train.cuda_graphs refuses FSDP2)")
        params = list(self.trained.parameters())
        self.graphs = MicroBatchGraphs(self._forward_backward, params) if cuda_graphs else None
        self.info = {
            "ops": _ops_info(self.model),
            "cuda_graphs": cuda_graphs,
            "attn_implementation": self.model.config._attn_implementation,
            "precision": precision,
            "optimizer": "veomni.train.optim.build_adamw (torch AdamW, fused)",
            "packing": "cu_seq_lens_q/k + max_length_q/k + position_ids (veomni.train.data.model_inputs)",
            "activation_checkpointing": policy.activation_checkpointing,
        }  # fmt: skip
        if self.fsdp:
            self.info["reshard_after_forward"] = policy.reshard_after_forward

    def step(
        self, micro_batches: Sequence[dict[str, Any]], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        world = self.state.dims.world_size
        loss_sum = torch.zeros((), device=self.s.device)
        for i, batch in enumerate(micro_batches):
            if self.fsdp:
                set_grad_sync(self.model, is_last_microstep=i == len(micro_batches) - 1)
            kwargs = {
                **model_inputs(batch), **veomni_vision_inputs(batch), "shift_labels": batch["labels"],
                "num_items_in_batch": num_items, "use_cache": False,
            }  # fmt: skip
            if self.graphs is not None:
                loss_sum += self.graphs(static_packing(kwargs), world).float()
            else:
                loss_sum += self._forward_backward(kwargs, world).float()
        norm, _ = clip_and_step(self.optimizer, self.trained, self.s.max_grad_norm, self.state)
        if self.masters is not None:
            self.masters.push()
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        return loss_sum, norm

    def _forward_backward(self, kwargs: dict[str, Any], world: int) -> torch.Tensor:
        with use_parallel_state(self.state):
            out = self.model(**kwargs)
        # veomni.train.loop's convention: FSDP averages over the world, the objective sums over ranks.
        (out.loss * world).backward()
        return out.loss.detach()


class HF(Contender):
    """Plain transformers with SDPA; packing detected by HF from position_ids; optionally Liger on top."""

    def __init__(self, s: Settings, liger: bool) -> None:
        self.s = s
        dtype = torch.bfloat16 if s.hf_master == "bf16" else torch.float32
        self.model = HF_AUTO[s.task].from_pretrained(s.weights, attn_implementation="sdpa", dtype=dtype)
        self.model.to(s.device)
        self.model.train()
        if liger:
            import liger_kernel.transformers as liger_transformers

            patch_name, kernels = LIGER_PATCHES[self.model.config.model_type]
            # Liger 0.8.5's Qwen3-VL fused-linear-CE forward reads ``outputs.rope_deltas``, which transformers
            # 5.23's Qwen3VLModel no longer returns: patch its kernels, and run its fused linear CE ourselves.
            by_hand = self.model.config.model_type in LIGER_LCE_BY_HAND
            getattr(liger_transformers, patch_name)(
                **kernels, cross_entropy=False, fused_linear_cross_entropy=not by_hand, model=self.model
            )
            if by_hand:
                self.model.forward = functools.partial(_liger_vl_forward, self.model)
        if s.ac == "all":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.autocast = s.precision == "bf16" and s.hf_master == "fp32"
        groups = [
            {k: v for k, v in g.items() if k != "names"} for g in param_groups(self.model, s.weight_decay)
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        if s.hf_master == "bf16":
            precision = "bf16 parameters, gradients and AdamW state (no fp32 master copy)"
        elif self.autocast:
            precision = "fp32 master weights, torch.autocast(bfloat16)"
        else:
            precision = "fp32 throughout"
        self.info = {
            "attn_implementation": self.model.config._attn_implementation,
            "precision": precision,
            "optimizer": "torch.optim.AdamW(fused=True), same param groups and hyper-parameters as veomni",
            "packing": "position_ids only (HF builds a packed causal mask for SDPA)",
            "activation_checkpointing": s.ac == "all",
        }
        if liger:
            self.info["liger"] = {
                "version": importlib.metadata.version("liger-kernel"),
                "patched": f"{patch_name}({', '.join(kernels)}, fused_linear_cross_entropy)",
            }
            if by_hand:
                self.info["liger"]["compat"] = [
                    _liger_compat() or "VLM output-class aliases in place",
                    "fused linear CE: liger's LigerForCausalLMLoss on the model's hidden states "
                    "(_liger_vl_forward), since liger's VLM lce_forwards fail on transformers 5.23",
                ]

    def step(
        self, micro_batches: Sequence[dict[str, Any]], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), device=self.s.device)
        for batch in micro_batches:
            with torch.autocast(self.s.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                out = self.model(
                    input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                    shift_labels=batch["labels"], num_items_in_batch=num_items, use_cache=False,
                    **vision_inputs(batch),
                )  # fmt: skip
            out.loss.backward()
            loss_sum += out.loss.detach().float()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm


def _liger_vl_forward(model: nn.Module, **kwargs: Any) -> Any:
    """Qwen3-VL's training forward with Liger's fused linear cross-entropy: what liger's ``lce_forward`` does,
    minus its read of ``rope_deltas`` (absent from transformers 5.23's outputs). Returns an object with ``.loss``."""
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss, unpack_cross_entropy_result
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    hidden = model.model(**kwargs).last_hidden_state
    result = LigerForCausalLMLoss(
        hidden_states=hidden, lm_head_weight=model.lm_head.weight, labels=labels, shift_labels=shift_labels,
        hidden_size=model.config.text_config.hidden_size, num_items_in_batch=num_items,
    )  # fmt: skip
    return CausalLMOutputWithPast(loss=unpack_cross_entropy_result(result)[0])


# (transformers module, output class liger 0.8.5 imports): removed in transformers 5.23, whose VLMs return a plain
# ``CausalLMOutputWithPast``; liger's output_classes then lacks its subclass and its VLM patch modules fail to import.
_LIGER_REMOVED_OUTPUTS = (
    ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLCausalLMOutputWithPast"),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLCausalLMOutputWithPast"),
)


def _liger_compat() -> str | None:
    """Alias each output class of `_LIGER_REMOVED_OUTPUTS` to ``CausalLMOutputWithPast`` before liger is imported,
    so ``apply_liger_kernel_to_qwen3_vl`` / ``_qwen2_5_vl`` import; returns what was done (for the JSON), or None
    when nothing was needed."""
    import importlib

    from transformers.modeling_outputs import CausalLMOutputWithPast

    done = []
    for module_name, name in _LIGER_REMOVED_OUTPUTS:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            setattr(module, name, CausalLMOutputWithPast)
            done.append(f"{module_name}.{name}")
    if not done:
        return None
    return (
        f"{', '.join(done)} aliased to CausalLMOutputWithPast (removed in transformers 5.23; liger 0.8.5's VLM "
        "modules import them)"
    )


def _liger_problem(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"liger-kernel needs CUDA; this run is on {device.type}"
    _liger_compat()
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as err:
        return f"liger_kernel does not import ({err}); install veomni-kernels[liger]"
    return None


class VeomniPlain(Contender):
    """What veomni-train runs on one rank when ``model.param_dtype`` equals ``model.dtype``: veomni's model and
    kernels as a plain module (no FSDP2), parameters, gradients and AdamW state in the compute dtype (pure bf16
    for ``--precision bf16``, like BENCHMARKS.md's peer rows), veomni's AdamW and clipping; decoder blocks compiled
    when ``compile_setting`` is ``"on"``."""

    def __init__(self, s: Settings, compile_setting: str = "off", cuda_graphs: bool = False) -> None:
        self.s = s
        self.state = build_parallel_state(ParallelDims.for_world(dist.get_world_size()), s.device.type)
        ops = _ops(s, compile_setting)
        dtype = torch.bfloat16 if s.precision == "bf16" else torch.float32
        self.model = build_model(
            s.weights, weights=s.weights, ops=ops, dtype=dtype, device=s.device, task=s.task
        )
        self.compile_stats = compile_stats(self.model)
        ac = s.ac in ("veomni", "all")
        if ac:
            apply_activation_checkpointing(self.model, default_fsdp_policy(self.model).block_patterns)
        self.model.train()
        self.optimizer = build_adamw(
            self.model, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=s.weight_decay
        )
        # train.cuda_graphs: each micro-batch's forward + backward replayed from a captured graph.
        self.graphs = (
            MicroBatchGraphs(self._forward_backward, list(self.model.parameters())) if cuda_graphs else None
        )
        self.info = {
            "ops": _ops_info(self.model),
            "cuda_graphs": cuda_graphs,
            "precision": f"no FSDP: {dtype} parameters, gradients and AdamW state",
            "optimizer": "veomni.train.optim.build_adamw (torch AdamW, fused)",
            "activation_checkpointing": ac,
        }  # fmt: skip

    def step(
        self, micro_batches: Sequence[dict[str, Any]], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), device=self.s.device)
        for batch in micro_batches:
            kwargs = {
                **model_inputs(batch), **veomni_vision_inputs(batch), "shift_labels": batch["labels"],
                "num_items_in_batch": num_items, "use_cache": False,
            }  # fmt: skip
            if self.graphs is not None:
                loss_sum += self.graphs(static_packing(kwargs)).float()
            else:
                loss_sum += self._forward_backward(kwargs).float()
        norm, _ = clip_and_step(self.optimizer, self.model, self.s.max_grad_norm, self.state)
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        return loss_sum, norm

    def _forward_backward(self, kwargs: dict[str, Any]) -> torch.Tensor:
        with use_parallel_state(self.state):
            out = self.model(**kwargs)
        out.loss.backward()
        return out.loss.detach()


BUILDERS: dict[str, Callable[[Settings], Contender]] = {
    "veomni": Veomni,
    "veomni_compiled": lambda s: Veomni(s, compile_setting="on"),
    "veomni_compiled_graphs": lambda s: Veomni(s, compile_setting="on", cuda_graphs=True),
    "veomni_plain": VeomniPlain,
    "veomni_plain_compiled": lambda s: VeomniPlain(s, compile_setting="on"),
    "veomni_plain_compiled_graphs": lambda s: VeomniPlain(s, compile_setting="on", cuda_graphs=True),
    "veomni_plain_graphs": lambda s: VeomniPlain(s, cuda_graphs=True),
    "hf": lambda s: HF(s, liger=False),
    "hf_liger": lambda s: HF(s, liger=True),
}
