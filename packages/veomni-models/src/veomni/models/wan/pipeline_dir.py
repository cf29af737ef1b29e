"""The Wan2.1 diffusers pipeline directory the frozen condition models load from
(`veomni.models.wan.condition.WanConditionModel.from_pretrained`): its layout, its weight files, and the
random-weight builds used by toy runs.

Layout read (the one ``WanPipeline`` / ``WanImageToVideoPipeline`` load)::

    <root>/text_encoder/   UMT5EncoderModel          (transformers)
    <root>/tokenizer/      the UMT5 tokenizer        (transformers AutoTokenizer)
    <root>/vae/            AutoencoderKLWan          (diffusers)
    <root>/scheduler/      FlowMatchEulerDiscreteScheduler, or UniPC with use_flow_sigmas (shift only is read)
    <root>/image_encoder/  CLIPVisionModel           (I2V only)
    <root>/image_processor CLIPImageProcessor        (I2V only)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from torch import nn

__all__ = [
    "ConditionCheckpointError",
    "check_weight_files",
    "locate_wan_components",
    "random_condition_models",
]


# Subfolder -> (file that must exist in it, what it holds).
_T2V_COMPONENTS = {
    "text_encoder": ("config.json", "the UMT5EncoderModel text encoder"),
    "tokenizer": ("tokenizer_config.json", "the UMT5 tokenizer"),
    "vae": ("config.json", "the AutoencoderKLWan VAE"),
    "scheduler": ("scheduler_config.json", "the flow-matching scheduler config"),
}
_I2V_COMPONENTS = {
    "image_encoder": ("config.json", "the CLIPVisionModel image encoder"),
    "image_processor": ("preprocessor_config.json", "the CLIPImageProcessor"),
}


# model_index.json _class_name -> the mode its components serve (Wan2.1; others are refused, not guessed).
_PIPELINE_MODES = {"WanPipeline": "t2v", "WanImageToVideoPipeline": "i2v"}


class ConditionCheckpointError(FileNotFoundError):
    """The checkpoint directory is not a Wan diffusers pipeline directory, or lacks a condition component."""


def locate_wan_components(root: str | Path, mode: Literal["t2v", "i2v"] = "t2v") -> dict[str, Path]:
    """Check that ``root`` is a Wan diffusers pipeline directory holding every condition component.

    Returns:
        subfolder name -> its path, for ``text_encoder``, ``tokenizer``, ``vae``, ``scheduler`` (and for I2V
        ``image_encoder``, ``image_processor``).
    Raises:
        ConditionCheckpointError: ``root`` is not a directory, is a single model's directory (a transformers
            checkpoint, or a diffusers model such as the ``transformer/`` subfolder), its ``model_index.json``
            (when present) names a pipeline other than ``WanPipeline`` (t2v) / ``WanImageToVideoPipeline``
            (i2v) or the other mode, or it lacks components; the message names each missing subfolder and
            file and where it looked.
    """
    root = Path(root)
    if not root.is_dir():
        raise ConditionCheckpointError(
            f"Wan checkpoint directory {root} does not exist or is not a directory"
        )
    root_config = root / "config.json"
    if root_config.is_file():
        raw = json.loads(root_config.read_text())
        kind = (
            f"a transformers checkpoint (model_type {raw.get('model_type')!r})"
            if "model_type" in raw and "_class_name" not in raw
            else f"a single diffusers model ({raw.get('_class_name')!r})"
        )
        raise ConditionCheckpointError(
            f"{root} is {kind}, not a Wan pipeline directory: pass the directory holding model_index.json and the "
            f"subfolders {sorted(_T2V_COMPONENTS)} (the DiT itself is in its transformer/ subfolder)"
        )
    index_file = root / "model_index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        pipeline = index.get("_class_name")
        if pipeline not in _PIPELINE_MODES:
            raise ConditionCheckpointError(
                f"{index_file}: pipeline _class_name {pipeline!r} is not supported; expected one of "
                f"{sorted(_PIPELINE_MODES)}"
            )
        if _PIPELINE_MODES[pipeline] != mode:
            raise ConditionCheckpointError(
                f"{index_file}: a {pipeline} checkpoint serves mode {_PIPELINE_MODES[pipeline]!r}, but the "
                f"condition model was asked for mode {mode!r} (WanConditionConfig.mode)"
            )
        # Wan2.2 reuses these pipeline classes: two expert transformers split at boundary_ratio (the transformer/
        # subfolder then serves only the high-noise timesteps), or per-token timesteps (expand_timesteps).
        second = index.get("transformer_2")
        wan22 = [f"{k}={index[k]!r}" for k in ("boundary_ratio", "expand_timesteps") if index.get(k)]
        if isinstance(second, list) and any(part is not None for part in second):
            wan22.insert(0, f"transformer_2={second!r}")
        if wan22:
            raise ConditionCheckpointError(
                f"{index_file}: a Wan2.2 pipeline ({', '.join(wan22)}); only Wan2.1 pipelines are supported (one "
                "transformer trained over the whole timestep range, one timestep per sample)"
            )
    wanted = dict(_T2V_COMPONENTS) | (_I2V_COMPONENTS if mode == "i2v" else {})
    missing = [
        f"{name}/{file} ({what})"
        for name, (file, what) in wanted.items()
        if not (root / name / file).is_file()
    ]
    if missing:
        raise ConditionCheckpointError(
            f"Wan checkpoint directory {root} lacks condition components for mode {mode!r}: "
            + "; ".join(missing)
        )
    return {name: root / name for name in wanted}


# Subfolder -> weight file patterns one of which must exist for init="pretrained".
_WEIGHT_FILES = {
    "text_encoder": ("model*.safetensors", "pytorch_model*.bin"),
    "vae": ("diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.bin"),
    "image_encoder": ("model*.safetensors", "pytorch_model*.bin"),
}


def check_weight_files(parts: Mapping[str, Path]) -> None:
    """Raise `ConditionCheckpointError` naming every component of ``parts`` (`locate_wan_components`) that has
    a config but no weight file (for ``init="pretrained"``)."""
    missing = [
        f"{parts[name]} (expected {' or '.join(patterns)})"
        for name, patterns in _WEIGHT_FILES.items()
        if name in parts and not any(any(parts[name].glob(pattern)) for pattern in patterns)
    ]
    if missing:
        raise ConditionCheckpointError(
            "the Wan condition models have a config but no weights in: "
            + "; ".join(missing)
            + ". Download the full pipeline (or, for a toy run only, build them with random weights: "
            "init='random', recipe dit.condition_init=random)"
        )


def random_condition_models(
    parts: Mapping[str, Path], mode: str, seed: int
) -> tuple[nn.Module, nn.Module, nn.Module | None]:
    """``(text_encoder, vae, image_encoder or None)`` with random weights, for toy runs and tests.

    ``parts`` is `locate_wan_components`' result; ``seed`` seeds a forked RNG, so the global stream is unchanged.
    """
    # Built from their configs alone; the fork keeps the caller's RNG stream untouched.
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config.from_pretrained(parts["text_encoder"]))
        vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(parts["vae"]))
        image_encoder = None
        if mode == "i2v":
            from transformers import CLIPVisionConfig, CLIPVisionModel

            image_encoder = CLIPVisionModel(CLIPVisionConfig.from_pretrained(parts["image_encoder"]))
    return text_encoder, vae, image_encoder
