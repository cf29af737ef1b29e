"""The contenders of `bench_dit.py`: one Wan transformer + optimizer setup each, behind a common ``step``.

- ``diffusers``: plain diffusers, as its training examples do it: ``WanTransformer3DModel.from_pretrained(...,
  torch_dtype=...)`` (done by hand, same result, where accelerate is missing: `load_diffusers`), diffusers' own gradient checkpointing (``enable_gradient_checkpointing``), its default
  attention backend (``native``: ``F.scaled_dot_product_attention``, unless ``DIFFUSERS_ATTN_BACKEND`` says
  otherwise), ``F.mse_loss``, ``torch.nn.utils.clip_grad_norm_``, fused ``torch.optim.AdamW``.
- ``diffusers_<backend>``: the same with ``model.set_attention_backend(<backend>)``, one per diffusers attention
  backend (``diffusers_native_cudnn`` for ``_native_cudnn``, ``diffusers_flash`` for ``flash``, ...).
- ``diffusers_compiled``: the same with diffusers' regional compilation, ``compile_repeated_blocks(fullgraph=True)``.
- ``veomni``: veomni's build with ``ops=None`` (diffusers' own attention code) as veomni-train's one-rank path
  builds it when ``model.param_dtype`` equals ``model.dtype``
  (`veomni.train.loop.build_recipe_model`): ``build_model`` on the diffusers config (meta construction, weights
  streamed by veomni's loader, ``_keep_in_fp32_modules`` honoured), veomni's activation checkpointing per
  ``_no_split_modules`` block, `build_adamw`, veomni's `clip_grad_norm`, `DitTask`'s loss formula.
- ``veomni_kernels``: ``veomni`` with the device's ``OpsConfig`` defaults bound (`veomni.models.wan.kernels`: veomni's
  RMSNorm and interleaved-rotary Triton kernels and its attention kernel, ``varlen`` on CUDA for bf16), eager blocks:
  what veomni-train builds with ``ops.compile: off``.
- ``veomni_compiled``: ``veomni_kernels`` with ``OpsConfig(compile="on")``: ``build_model`` compiles every block
  (`veomni.core.compile.compile_blocks`, inductor, ``fullgraph=True``; defaulted rms_norm/rope take the eager
  formulas inductor fuses) before checkpointing: what veomni-train builds on CUDA by default (``compile: auto``).
- ``veomni_keep_attention``: ``veomni_kernels`` with ``parallel.ac_keep_attention`` (eager blocks only).
- ``veomni_fa4``: ``veomni_kernels`` with ``ops.attention: flash_attn_4`` (FlashAttention 4 from PyPI's
  ``flash-attn-4``; diffusers reaches the same kernel only through its Hub backend ``flash_4_hub``, listed as a
  skipped contender where the Hub is out of reach). Not with ``keep_attention``: checkpointing cannot see
  FlashAttention's own kernel launches, so that combination is refused at the first forward.

Both sides train the same parameters with the same AdamW hyper-parameters and parameter groups, in the same dtype
policy (parameters, gradients and AdamW state in ``--precision``, ``_keep_in_fp32_modules`` in fp32).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.clip import clip_grad_norm
from veomni.core.compile import CompileStats, compile_blocks, compile_stats
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import OpsConfig
from veomni.kernels.hardware import Hardware, detect_hardware
from veomni.models.build import block_patterns, build_model
from veomni.train.optim import build_adamw, param_groups

# Wan2.1-T2V-1.3B-Diffusers transformer/config.json (its __init__ arguments).
WAN_T2V_1_3B: dict[str, Any] = {
    "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}  # fmt: skip

# Backends that train on CUDA only (torch's cuDNN / memory-efficient / flash SDPA kernels, flash-attn, sage,
# xformers; FlexAttention has no backward on CPU), and those that take bf16/fp16 inputs only.
CUDA_ONLY = {"_native_cudnn", "_native_efficient", "_native_flash", "flex", "flash", "flash_varlen", "_flash_3",
             "_flash_varlen_3", "sage", "sage_varlen", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90",
             "_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton", "xformers"}  # fmt: skip
HALF_ONLY = CUDA_ONLY - {"_native_efficient", "flex", "xformers"}
# Available but not run unless named: at 480p x 81 frames (32,760 tokens) they cannot fit or finish.
NOT_BY_DEFAULT = {
    "_native_math": "torch's math SDPA materialises the [B, 12, S, S] scores (26 GB in bf16 per call at "
    "S = 32,760, more in its backward)",
    "flex": "diffusers calls flex_attention outside torch.compile, i.e. torch's unfused reference path, which "
    "materialises the scores like math SDPA",
}


@attrs.define
class DitSettings:
    """What every contender shares (from the command line)."""

    device: torch.device
    weights: str  # directory holding the seeded initial weights (diffusers layout)
    dtype: torch.dtype  # parameters, gradients, AdamW state (bf16 benchmark, fp32 parity)
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float
    ac: bool  # activation checkpointing of every transformer block, for every contender
    compile_backend: str = "inductor"


class DitContender:
    """A model and its optimizer. ``info`` describes the setup for the JSON; ``compile_stats`` counts the graphs
    of veomni's compiled blocks (None otherwise).

    ``step(batch)`` runs one optimizer step on ``batch`` (`bench_dit.make_steps`: ``hidden_states``
    ``[B, C, F, H, W]`` and ``encoder_hidden_states`` ``[B, L, text_dim]`` in the compute dtype, ``timestep``
    float32 ``[B]``, ``target`` float32 ``[B, C, F, H, W]``) and returns ``(loss, grad_norm)``, 0-d fp32 tensors:
    the mean squared error before the update and the gradient norm before clipping.
    """

    info: dict[str, Any]
    model: nn.Module
    compile_stats: CompileStats | None = None

    def step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def _predict(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        hidden_states=batch["hidden_states"], timestep=batch["timestep"],
        encoder_hidden_states=batch["encoder_hidden_states"], return_dict=False,
    )[0]  # fmt: skip


def _adamw_info(s: DitSettings) -> str:
    return f"AdamW(fused, lr={s.lr}, betas={s.betas}, eps={s.eps}, wd={s.weight_decay} on >= 2-D params)"


class Diffusers(DitContender):
    """Plain diffusers (see the module docstring); ``backend`` None keeps diffusers' active default."""

    def __init__(self, s: DitSettings, backend: str | None = None, compiled: bool = False) -> None:
        self.s = s
        model, how = load_diffusers(s.weights, s.dtype)
        self.model = model.to(s.device)
        if backend is not None:
            self.model.set_attention_backend(backend)
        if compiled:
            self.model.compile_repeated_blocks(fullgraph=True, backend=s.compile_backend)
        if s.ac:
            self.model.enable_gradient_checkpointing()
        self.model.train()
        groups = [
            {k: v for k, v in g.items() if k != "names"} for g in param_groups(self.model, s.weight_decay)
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, fused=True)
        self.info = {
            "build": f"{how}, then .to({s.device.type})",
            "attention": backend or f"{active_backend()} (diffusers' active default)",
            "compile": f"compile_repeated_blocks(fullgraph=True, backend={s.compile_backend!r})" if compiled else "off",
            "activation_checkpointing": "diffusers enable_gradient_checkpointing (every block)" if s.ac else "off",
            "loss": "F.mse_loss(pred.float(), target.float())",
            "optimizer": "torch.optim.AdamW, veomni's param_groups; " + _adamw_info(s),
            "clip": "torch.nn.utils.clip_grad_norm_",
        }  # fmt: skip

    def step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = _predict(self.model, batch)
        loss = F.mse_loss(prediction.float(), batch["target"].float())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm


def load_diffusers(weights: str, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """``WanTransformer3DModel.from_pretrained(weights, torch_dtype=dtype)`` on the CPU, and how it was loaded.

    Without accelerate diffusers refuses to load a class with ``_keep_in_fp32_modules`` (Wan); the same result is
    then built by hand: construction without init, ``load_state_dict``, parameters cast to ``dtype`` except those
    whose name contains a ``_keep_in_fp32_modules`` entry (diffusers' own substring rule), which stay fp32.
    """
    from diffusers import WanTransformer3DModel
    from diffusers.models import modeling_utils
    from safetensors.torch import load_file

    if modeling_utils.is_accelerate_available():
        model = WanTransformer3DModel.from_pretrained(weights, torch_dtype=dtype)
        return model, f"WanTransformer3DModel.from_pretrained(torch_dtype={dtype})"
    with modeling_utils.no_init_weights():
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(weights))
    model.load_state_dict(load_file(os.path.join(weights, "diffusion_pytorch_model.safetensors")))
    keep = tuple(model._keep_in_fp32_modules or ())
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if any(k in name for k in keep) else dtype)
    return model, (
        f"accelerate is not installed, so diffusers' from_pretrained refuses Wan: from_config without init + "
        f"load_state_dict + parameters cast to {dtype}, _keep_in_fp32_modules kept fp32"
    )


def _ops(s: DitSettings, compile_setting: str, attention: str | None = None) -> OpsConfig:
    # Validated against the device we run on, not whatever CUDA the process could see.
    hardware = detect_hardware()
    if s.device.type != hardware.device_type:
        hardware = Hardware(device_type=s.device.type, triton_interpret=hardware.triton_interpret)
    chosen = {} if attention is None else {"attention": attention}
    return OpsConfig(compile=compile_setting, hardware=hardware, **chosen)


class Veomni(DitContender):
    """veomni-train's one-rank path (see the module docstring). ``kernels`` False builds with ``ops=None``
    (diffusers' own attention code inside veomni's build, checkpointing, optimizer and loss: the baseline of the
    binding); True with the device's ``OpsConfig`` defaults, as `veomni.train.tasks.dit_setup` passes them
    (`veomni.models.wan.kernels`: veomni's RMSNorm, interleaved rotary and attention kernels). ``compiled`` is
    ``OpsConfig(compile="on")``: ``build_model`` compiles every block (inductor) before checkpointing."""

    def __init__(
        self,
        s: DitSettings,
        compiled: bool = False,
        keep_attention: bool = False,
        kernels: bool = False,
        attention: str | None = None,
    ) -> None:
        from veomni.models.wan.kernels import bound_wan_ops

        self.s = s
        if keep_attention and not s.ac:
            raise ValueError("veomni_keep_attention chooses what checkpointing keeps: it needs --ac on")
        if compiled and not kernels:
            raise ValueError("the compiled veomni contender binds the kernels: OpsConfig(compile='on')")
        self.state = build_parallel_state(ParallelDims.for_world(1), s.device.type)
        # OpsConfig(compile="on") compiles with inductor inside build_model; another dynamo backend (aot_eager for
        # the CPU smoke test) gets the same kernels (`for_compiled_blocks`) and compile_blocks after the build.
        by_build = compiled and s.compile_backend == "inductor"
        if attention is not None and not kernels:
            raise ValueError(f"attention={attention!r} is a veomni kernel choice: it needs kernels=True")
        ops = _ops(s, "on" if by_build else "off", attention) if kernels else None
        if compiled and not by_build:
            ops = ops.for_compiled_blocks()
        build = {"weights": s.weights, "dtype": s.dtype, "device": s.device, "task": "diffusion_transformer"}
        self.model = build_model(s.weights, ops=ops, **build)
        patterns = block_patterns(self.model)
        compile_note = "off"
        if by_build:
            compile_note = "OpsConfig(compile='on') inside build_model (inductor)"
        elif compiled:
            compile_blocks(self.model, patterns, backend=s.compile_backend)
            compile_note = f"compile_blocks({patterns}, backend={s.compile_backend!r}) after build_model"
        self.compile_stats = compile_stats(self.model)
        if s.ac:
            apply_activation_checkpointing(self.model, patterns, keep_attention=keep_attention)
        self.model.train()
        self.optimizer = build_adamw(
            self.model, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay
        )
        bound = bound_wan_ops(self.model).names
        self.info = {
            "build": f"veomni build_model(dtype={s.dtype}, device={s.device.type}, task='diffusion_transformer')",
            "ops": None if ops is None else {k: getattr(ops, k) for k in ("attention", "rms_norm", "rope", "compile")},
            "wan_ops": bound,
            "attention": (f"{active_backend()} (diffusers' dispatch inside diffusers' WanAttnProcessor)"
                          if ops is None else f"veomni attention {bound['attention']!r} (WanKernelAttnProcessor)"),
            "compile": compile_note,
            "activation_checkpointing": (
                f"veomni apply_activation_checkpointing({patterns}, keep_attention={keep_attention})"
                if s.ac else "off"
            ),
            "loss": "DitTask's: per-sample MSE in fp32, summed / samples",
            "optimizer": "veomni.train.optim.build_adamw; " + _adamw_info(s),
            "clip": "veomni.core.clip.clip_grad_norm",
        }  # fmt: skip

    def step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with use_parallel_state(self.state):
            prediction = _predict(self.model, batch)
        target = batch["target"]
        per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)
        loss = per_sample.sum() / target.shape[0]
        loss.backward()
        norm = clip_grad_norm(self.model, self.s.max_grad_norm, self.state)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm


def active_backend() -> str:
    """diffusers' process-wide default attention backend (``DIFFUSERS_ATTN_BACKEND``, else ``native``)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = _AttentionBackendRegistry._active_backend
    return getattr(backend, "value", str(backend))


def backend_contenders() -> dict[str, str]:
    """``diffusers_<name>`` -> diffusers attention backend, for every backend this diffusers registers except
    ``native`` (that is the plain ``diffusers`` contender's default)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    registered = {getattr(b, "value", b) for b in _AttentionBackendRegistry._backends}
    return {
        "diffusers_" + b.value.lstrip("_"): b.value
        for b in AttentionBackendName
        if b.value != "native" and b.value in registered
    }


def backend_problem(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why diffusers attention ``backend`` cannot run here (None when it can): a kernel downloaded from the Hub,
    a missing package (diffusers' own requirement check), CUDA-only kernels on CPU, half-only kernels in fp32."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
    )

    if backend.endswith("_hub"):
        return f"{backend} downloads its kernel from the Hugging Face Hub at first use; this benchmark downloads nothing"
    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except (RuntimeError, ImportError) as err:
        return f"{backend} is not usable here: {err}"
    if backend in {"_native_npu", "_native_xla"}:
        return f"{backend} runs on NPU / XLA devices only"
    if backend in CUDA_ONLY and device.type != "cuda":
        return (
            f"{backend} trains on CUDA only (no CPU kernel or no CPU backward); this run is on {device.type}"
        )
    if backend in HALF_ONLY and dtype not in (torch.bfloat16, torch.float16):
        return f"{backend} takes bf16/fp16 inputs only; this run computes in {dtype}"
    return None


def param_dtypes(model: nn.Module) -> dict[str, int]:
    """Parameter elements per dtype (``{"torch.bfloat16": n, "torch.float32": m}``): the dtype policy, compared
    across contenders."""
    counts: dict[str, int] = collections.Counter()
    for p in model.parameters():
        counts[str(p.dtype)] += p.numel()
    return dict(sorted(counts.items()))


BUILDERS: dict[str, Callable[[DitSettings], DitContender]] = {
    "diffusers": Diffusers,
    "diffusers_compiled": lambda s: Diffusers(s, compiled=True),
    "veomni": Veomni,
    "veomni_kernels": lambda s: Veomni(s, kernels=True),
    "veomni_compiled": lambda s: Veomni(s, kernels=True, compiled=True),
    # parallel.ac_keep_attention: the attention outputs saved, the rest of each block recomputed (eager blocks).
    "veomni_keep_attention": lambda s: Veomni(s, kernels=True, keep_attention=True),
    # ops.attention: flash_attn_4 (FlashAttention 4, flash_attn.cute from PyPI's flash-attn-4).
    "veomni_fa4": lambda s: Veomni(s, kernels=True, attention="flash_attn_4"),
}


# Contenders that need one of veomni's optional attention kernels: skipped (with the reason) where it cannot run.
ATTENTION_OF = {"veomni_fa4": "flash_attn_4"}


def contender_problem(name: str, device: torch.device) -> str | None:
    """Why veomni contender ``name`` cannot run on ``device`` (None when it can): its optional attention kernel
    is missing (`ATTENTION_OF`)."""
    from veomni.kernels.attention import available_attention_functions

    attention = ATTENTION_OF.get(name)
    if attention is None:
        return None
    if device.type != "cuda":
        return f"attention {attention!r} runs on CUDA only, this run is on {device.type}"
    why = available_attention_functions()[attention]
    return None if why == "ok" else f"attention {attention!r}: {why}"


def builder(name: str) -> Callable[[DitSettings], DitContender]:
    """The constructor of contender ``name`` (a `BUILDERS` key or ``diffusers_<backend>``); KeyError otherwise."""
    if name in BUILDERS:
        return BUILDERS[name]
    backend = backend_contenders()[name]
    return lambda s: Diffusers(s, backend=backend)
