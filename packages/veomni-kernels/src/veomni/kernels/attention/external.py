"""Attention backends outside torch's core: ``varlen`` (torch.nn.attention.varlen) and FlashAttention 2/3/4.

Same calling convention as ``functions.py``. A sliding window ``W`` is the flash-style window ``(W - 1, 0)`` (the
query and the ``W - 1`` keys before it). Packages are imported on first call; a missing package or a
non-CUDA tensor is an error naming what is missing, never a fallback to another backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from typing import Any

import torch

from veomni.kernels.attention.features import check_features
from veomni.kernels.attention.functions import check_qkv, sdpa_attention

# name -> (module imported on first use, pip package that provides it)
_FLASH_MODULES = {
    "flash_attn_2": ("flash_attn", "flash-attn"),
    "flash_attn_3": ("flash_attn_interface", "flash-attn-3 (FlashAttention's hopper/ build)"),
    "flash_attn_4": ("flash_attn.cute", "flash-attn-4 (FlashAttention 4, flash_attn.cute)"),
}
# What proves each install is there: FlashAttention 4's wheel alone also makes ``flash_attn`` importable (a
# namespace holding ``cute``), so FlashAttention 2 is its ``flash_attn_interface`` submodule, not the bare name.
_FLASH_PROBES = {
    "flash_attn_2": "flash_attn.flash_attn_interface",
    "flash_attn_3": "flash_attn_interface",
    "flash_attn_4": "flash_attn.cute",
}


FLASH_4_MIN_TRAINED_HEAD = 32
"""The smallest head size whose FlashAttention 4 gradients were measured right (flash-attn-4 4.0.0b36 on SM90: 16
wrong, 32, 64, 128 right); applied to every release and GPU generation until one is measured otherwise."""


def _module_present(module: str) -> bool:
    """Whether ``module`` could be imported, without importing it (for dotted names, nor its parents)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    roots = spec.submodule_search_locations or []
    sub = rest.replace(".", os.sep)
    return any(
        os.path.isdir(os.path.join(r, sub)) or os.path.isfile(os.path.join(r, sub + ".py")) for r in roots
    )


def flash_problem(name: str) -> str | None:
    """Why FlashAttention ``name`` (``flash_attn_2/3/4``) is not installed (None when it is), checked without
    importing anything: 2 and 4 share the ``flash_attn`` package name, so each is probed by its own submodule
    (`_FLASH_PROBES`)."""
    probe, package = _FLASH_PROBES[name], _FLASH_MODULES[name][1]
    return None if _module_present(probe) else f"needs the {package} package (module {probe!r} not found)"


def flash_2_problem(hw: object) -> str | None:
    """The registry condition of ``flash_attn_2`` (`flash_problem`)."""
    return flash_problem("flash_attn_2")


def flash_4_problem(hw: object) -> str | None:
    """The registry condition of ``flash_attn_4`` (`flash_problem`)."""
    return flash_problem("flash_attn_4")


def _unavailable_reason(name: str) -> str | None:
    if name == "varlen":
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
    else:
        problem = flash_problem(name)
        if problem is not None:
            return problem
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def _require(name: str, device: torch.device) -> None:
    if torch.compiler.is_compiling():
        # Dynamo cannot trace importlib's find_spec; a compiled block's first call runs eagerly and checked this.
        return
    reason = _unavailable_reason(name)
    if reason is None and device.type != "cuda":
        reason = f"runs on CUDA tensors only, got {device}"
    if reason is not None:
        raise RuntimeError(f"attention {name!r} is unavailable: {reason}")


def _packed_layout(
    q: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None
) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` for the ``[B*S, H, D]`` view; unpacked batches become B equal segments."""
    batch, seq = q.shape[:2]
    if cu_seqlens is None:
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device)
        return cu, seq
    cu = cu_seqlens.to(q.device)
    if max_seqlen is None:
        # One host sync; pass max_seqlen (the data pipeline knows it) to avoid it.
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    return cu, max_seqlen


def _pad_value(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``v`` zero-padded to q's head size: the fused kernels here take one head size for q, k and v.

    Zero value columns give zero output columns, so slicing the output back to ``v``'s head size is exact
    (DeepSeek's MLA: D = 192, Dv = 128). FlashAttention 3/4 can run some such pairs natively; padding is the
    one path that every build and torch's varlen accept.
    """
    extra = q.shape[-1] - v.shape[-1]
    if extra < 0:
        raise ValueError(
            f"value head size {v.shape[-1]} exceeds the query/key head size {q.shape[-1]}; these fused "
            "kernels take one head size (use attention 'sdpa', 'flex' or 'eager')"
        )
    return torch.nn.functional.pad(v, (0, extra)) if extra else v


def _first(result: Any) -> torch.Tensor:
    # Some FlashAttention builds return (out, lse) tuples; the output always comes first.
    out: torch.Tensor = result[0] if isinstance(result, tuple) else result
    return out


@functools.cache
def _parameters(fn: Any) -> frozenset[str]:
    """``fn``'s parameter names, plus ``"**"`` when it takes ``**kwargs``. inspect.signature costs tens of
    microseconds: once per function, not once per layer and step."""
    params = inspect.signature(fn).parameters
    variadic = {"**"} if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set()
    return frozenset(params) | variadic


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (CUDA only) for packed rows; rows of one segment each (unpacked
    batches, or ``cu_seqlens`` ``[0, S]``) without a window run SDPA's unmasked kernels instead.

    Args / Returns: the ``functions.py`` convention; out ``[B, S, Hq, D]`` in q's dtype (bf16/fp16 inputs).
    Sliding windows only (torch's varlen backward ignores the log-sum-exp's gradient, so sinks cannot be
    rescaled in). Raises ``RuntimeError`` when torch lacks the module, there is no GPU or the tensors are not on
    CUDA.
    """
    check_qkv(q, k, v, cu_seqlens, causal=causal)
    check_features("varlen", q, causal, window, sinks, softcap)
    _require("varlen", q.device)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"attention backend varlen runs bf16/fp16 only, got {q.dtype}; train in bf16 (model.dtype) or pick "
            "another attention backend (sdpa, flex, eager)"
        )
    if window is None and (cu_seqlens is None or cu_seqlens.numel() == 2):
        # Every row is one segment (unpacked rows, or one long document per sequence / Ulysses group): SDPA's
        # unmasked causal kernels (cuDNN / flash) ran the Qwen3-8B SP4 step 1.29x (32k) and 1.50x (128k) faster
        # than varlen_attn on H200 (notebook/benchmarks-log.md, 2026-11-22 and 2026-11-27). Same maths, no mask.
        return sdpa_attention(q, k, v, causal=causal, scale=scale)
    from torch.nn.attention import varlen

    batch, seq, heads_q = q.shape[:3]
    head_v = v.shape[-1]
    v = _pad_value(q, v)
    cu, max_len = _packed_layout(q, cu_seqlens, max_seqlen)
    # Unpacked cross-attention (Sk != S): B equal key segments of their own length.
    cu_k, max_len_k = (cu, max_len) if k.shape[1] == seq else _packed_layout(k, None, None)
    params = _parameters(varlen.varlen_attn)
    kwargs: dict[str, Any] = {}
    # torch 2.10 spelled causality ``is_causal``; later releases use flash-style window_size (-1, 0).
    if "window_size" in params:
        kwargs["window_size"] = _window_size(causal, window)
    elif window is not None:
        raise RuntimeError(
            f"torch {torch.__version__}'s varlen_attn takes no window_size; needs a newer torch"
        )
    elif causal:
        kwargs["is_causal"] = True
    if scale is not None:
        if "scale" not in params:
            raise RuntimeError(f"torch {torch.__version__}'s varlen_attn takes no scale; needs a newer torch")
        kwargs["scale"] = scale
    if k.shape[2] != heads_q:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads_q // k.shape[2], dim=2)
            v = v.repeat_interleave(heads_q // v.shape[2], dim=2)
    out = varlen.varlen_attn(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k, max_len, max_len_k, **kwargs
    )
    return torch.unflatten(_first(out)[..., :head_v], 0, (batch, seq))


def _window_size(causal: bool, window: int | None) -> tuple[int, int]:
    # Flash-style (left, right) key ranges around the query; -1 is unbounded.
    if window is not None:
        return (window - 1, 0)
    return (-1, 0) if causal else (-1, -1)


def _flash(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    scale: float | None,
    features: dict[str, Any],
) -> torch.Tensor:
    check_qkv(q, k, v, cu_seqlens, causal=causal)
    check_features(name, q, causal, **features)
    _require(name, q.device)
    trains = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if name == "flash_attn_4" and q.shape[-1] < FLASH_4_MIN_TRAINED_HEAD and trains:
        raise ValueError(
            f"attention 'flash_attn_4' with head size {q.shape[-1]}: FlashAttention 4 (flash-attn-4 4.0.0b36 on "
            f"an H200) returns wrong gradients below head size {FLASH_4_MIN_TRAINED_HEAD} (16: dq off by up to "
            "100%; 32, 64, 128 correct; tools/bench/diag_fa4_layouts.py), its forward is right. Train this model "
            "with attention 'sdpa', 'varlen' or 'flash_attn_2'"
        )
    mod = importlib.import_module(_FLASH_MODULES[name][0])
    head_v = v.shape[-1]
    v = _pad_value(q, v)
    extra: dict[str, Any] = {}
    if features["window"] is not None:
        extra["window_size"] = _window_size(causal, features["window"])
    if features["softcap"] is not None:
        extra["softcap"] = features["softcap"]
    if features["sinks"] is not None:
        # Only FlashAttention 4 declares sinks (check_features refused them above for 2/3).
        extra["learnable_sink"] = features["sinks"]
    # FlashAttention maps query head h to KV head h // (Hq // Hkv): our GQA layout, no repeat needed.
    if cu_seqlens is None:
        fn = mod.flash_attn_func
        _check_accepts(name, fn, extra)
        return _first(fn(q, k, v, softmax_scale=scale, causal=causal, **extra))[..., :head_v]
    cu, max_len = _packed_layout(q, cu_seqlens, max_seqlen)
    fn = mod.flash_attn_varlen_func
    _check_accepts(name, fn, extra)
    kwargs: dict[str, Any] = {
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "softmax_scale": scale,
        "causal": causal,
        **extra,
    }
    # Some FlashAttention 4 releases derive the maximum length themselves and take no max_seqlen_*.
    params = _parameters(fn)
    if "max_seqlen_q" in params or "**" in params:
        kwargs.update(max_seqlen_q=max_len, max_seqlen_k=max_len)
    out = fn(q[0], k[0], v[0], **kwargs)
    return _first(out)[..., :head_v].unsqueeze(0)


def _check_accepts(name: str, fn: Any, extra: dict[str, Any]) -> None:
    params = _parameters(fn)
    missing = [key for key in extra if key not in params and "**" not in params]
    if missing:
        raise RuntimeError(f"this {name} build's {fn.__name__} takes no {missing}; install a newer release")


def flash_attn_2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """FlashAttention 2 (``flash_attn``; bf16/fp16 CUDA tensors), packed via ``flash_attn_varlen_func``."""
    features = {"window": window, "sinks": sinks, "softcap": softcap}
    return _flash("flash_attn_2", q, k, v, causal, cu_seqlens, max_seqlen, scale, features)


def flash_attn_3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """FlashAttention 3 (``flash_attn_interface``, Hopper; bf16/fp16 CUDA tensors)."""
    features = {"window": window, "sinks": sinks, "softcap": softcap}
    return _flash("flash_attn_3", q, k, v, causal, cu_seqlens, max_seqlen, scale, features)


def flash_attn_4(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """FlashAttention 4 (``flash_attn.cute``, Hopper/Blackwell; bf16/fp16 CUDA tensors); windows, soft-cap and
    sinks (its ``learnable_sink``, differentiable) run inside the kernel."""
    features = {"window": window, "sinks": sinks, "softcap": softcap}
    return _flash("flash_attn_4", q, k, v, causal, cu_seqlens, max_seqlen, scale, features)


def available_attention_functions() -> dict[str, str]:
    """Every attention function name -> ``"ok"`` or why it cannot run here. Imports no optional package.

    ``flex`` is "ok" wherever torch has it, but on CPU it runs forward only (no backward).
    """
    status = {"eager": "ok", "sdpa": "ok"}
    has_flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    status["flex"] = "ok" if has_flex else f"torch {torch.__version__} has no flex_attention"
    for name in ("varlen", *_FLASH_MODULES):
        status[name] = _unavailable_reason(name) or "ok"
    return status
