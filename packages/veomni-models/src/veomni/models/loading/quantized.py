"""Quantized checkpoints are refused, with how to convert them, before anything reads their values.

veomni trains full-precision weights. A checkpoint published quantized (DeepSeek-V3/R1's FP8 block-scaled
weights: ``float8_e4m3fn`` tensors plus one ``weight_scale_inv`` per 128 x 128 block; GPT-OSS's MXFP4 experts)
would otherwise be read as plain numbers: FP8 values cast to fp32 without their scales, scale tensors reported
as unexpected keys. Both the config (``quantization_config``) and the tensors (FP8 dtypes, ``*_scale_inv``
keys, uint8 ``*_blocks`` / ``*_scales``) are looked at, so a quantized checkpoint is caught whether or not its
config travels with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# gpt-oss's published experts: ``gate_up_proj_blocks`` (packed FP4 values) and ``gate_up_proj_scales``, both uint8.
_MXFP4_SUFFIXES = ("_blocks", "_scales")

_FP8_HOW = (
    "Dequantise it once to bf16 with transformers and train from that copy:\n"
    "    from transformers import AutoModelForCausalLM, FineGrainedFP8Config\n"
    "    model = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16,\n"
    "        quantization_config=FineGrainedFP8Config(dequantize=True))\n"
    "    model.save_pretrained(DST, save_original_format=False)\n"
    "(each weight becomes fp8_weight * weight_scale_inv, one scale per 128 x 128 block). That holds the whole "
    "model in CPU memory; for DeepSeek-V3/R1 (671B) use DeepSeek's file-by-file converter instead: "
    "inference/fp8_cast_bf16.py --input-fp8-hf-path SRC --output-bf16-hf-path DST in the DeepSeek-V3 "
    "repository, then copy the config without its quantization_config."
)

_MXFP4_HOW = (
    "Dequantise it once to bf16 with transformers and train from that copy:\n"
    "    from transformers import AutoModelForCausalLM, Mxfp4Config\n"
    "    model = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16,\n"
    "        quantization_config=Mxfp4Config(dequantize=True))\n"
    "    model.save_pretrained(DST)  # bf16 experts (gate_up_proj / down_proj), no quantization_config\n"
    "(the published gpt-oss checkpoints store the experts as MXFP4 *_blocks / *_scales)."
)
_HOW = {"fp8": _FP8_HOW, "mxfp4": _MXFP4_HOW}


class QuantizedCheckpointError(ValueError):
    """The config or checkpoint is quantized; veomni trains unquantized weights only."""


def _describe(quant: Any) -> tuple[str, dict]:
    values = (
        quant.to_dict() if hasattr(quant, "to_dict") else dict(quant) if isinstance(quant, Mapping) else {}
    )
    method = str(values.get("quant_method", getattr(quant, "quant_method", "unknown")))
    return method, values


def quantization_problem(
    config: Any = None,
    tensors: Iterable[tuple[str, torch.dtype]] = (),
    *,
    where: str,
) -> str | None:
    """Why ``config`` / ``tensors`` cannot be trained as they are, with how to convert; None when unquantized.

    Args:
        config: a ``PretrainedConfig``, a raw ``config.json`` mapping, or None.
        tensors: ``(checkpoint key, dtype)`` of the checkpoint's tensors (headers only).
        where: what was inspected, for the message (a path or ``"the model config"``).
    """
    quant = None
    if isinstance(config, Mapping):
        quant = config.get("quantization_config")
    elif config is not None:
        quant = getattr(config, "quantization_config", None)
    fp8, scales, mxfp4 = [], [], []
    for key, dtype in tensors:
        if dtype in _FP8:
            fp8.append(key)
        elif key.endswith(_SCALE_SUFFIXES):
            scales.append(key)
        elif dtype == torch.uint8 and key.endswith(_MXFP4_SUFFIXES):
            mxfp4.append(key)
    if quant is None and not fp8 and not scales and not mxfp4:
        return None
    if quant is not None:
        method, values = _describe(quant)
        found = f"quantization_config {values or quant!r}"
    else:
        method = "fp8" if fp8 else "mxfp4" if mxfp4 else "unknown"
        found = "no quantization_config, but"
    if fp8 or scales:
        found += (
            f" {len(fp8)} FP8 tensors (e.g. {fp8[:2]}) and {len(scales)} scale tensors (e.g. {scales[:2]})"
        )
    if mxfp4:
        found += f" {len(mxfp4)} MXFP4 tensors (uint8 blocks and scales, e.g. {mxfp4[:2]})"
    how = _HOW.get(
        method,
        "Dequantise it to bf16 first (load it with transformers' quantizer set to dequantize, then "
        "save_pretrained) and train from that copy.",
    )
    return (
        f"{where} is quantized ({found}); veomni trains unquantized weights (bf16/fp32) and would otherwise read "
        f"quantized values without their scales.\n{how}"
    )


def check_not_quantized(
    config: Any = None, tensors: Iterable[tuple[str, torch.dtype]] = (), *, where: str
) -> None:
    """Raise `QuantizedCheckpointError` (see `quantization_problem`) for a quantized config or checkpoint."""
    problem = quantization_problem(config, tensors, where=where)
    if problem is not None:
        raise QuantizedCheckpointError(problem)
