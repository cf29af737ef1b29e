"""What the ``dit`` task asks of Wan2.1 before anything is built (`veomni.models.wan.family.DIFFUSION`): the
condition side read from a pipeline directory's configs, whether a transformer config fits it, and the
transformer's weights by what they multiply (its FLOPs count).

Only configs are read (VAE, scheduler, text and image encoder widths): no text encoder or VAE is loaded, so an
offline run (conditions precomputed by ``veomni-dit-embed``) keeps them off the GPUs.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from torch import nn

from veomni.models.diffusers.flow_matching import schedule_from_scheduler_config
from veomni.models.diffusers.rules import ConditionConfigs, Mismatch, WeightCounts
from veomni.models.wan.kernels import WAN_TEXT_CONTEXT_LEN
from veomni.models.wan.pipeline_dir import locate_wan_components

__all__ = ["compatibility", "condition_configs", "weight_counts"]

# WanTransformer3DModel's parameters (name fragments) that multiply context tokens rather than video tokens, or
# run once per sample; every other matrix multiplies each video token.
_TEXT_PARAMS = ("condition_embedder.text_embedder.", ".attn2.to_k.", ".attn2.to_v.", ".attn2.to_kv.")
_IMAGE_PARAMS = ("condition_embedder.image_embedder.", ".attn2.add_k_proj.", ".attn2.add_v_proj.",
                 ".attn2.to_added_kv.")  # fmt: skip
_SAMPLE_PARAMS = ("condition_embedder.time_embedder.", "condition_embedder.time_proj.")


def condition_configs(root: str | Path, mode: Literal["t2v", "i2v"], shift: float | None) -> ConditionConfigs:
    """The condition side of the Wan pipeline directory ``root`` for ``mode``, from its configs alone.

    Args:
        root: the pipeline directory (`veomni.models.wan.pipeline_dir.locate_wan_components`).
        mode: ``"t2v"``, or ``"i2v"`` (also the CLIP image encoder's width and token count).
        shift: the training timestep shift; None takes the scheduler config's.
    Raises:
        ConditionCheckpointError: a component is missing (the message names it and where it looked).
    """
    parts = locate_wan_components(root, mode)

    def read(name: str, file: str = "config.json") -> dict[str, Any]:
        return json.loads((parts[name] / file).read_text())

    from diffusers import AutoencoderKLWan

    # The class's defaults fill what the file leaves out (older Wan configs lack the scale factors), as
    # from_config would.
    signature = inspect.signature(AutoencoderKLWan.__init__).parameters.items()
    vae = {k: v.default for k, v in signature if v.default is not inspect.Parameter.empty} | read("vae")
    scheduler_file = parts["scheduler"] / "scheduler_config.json"
    schedule = schedule_from_scheduler_config(
        read("scheduler", "scheduler_config.json"), source=str(scheduler_file), shift=shift
    )
    image_dim, image_tokens = None, 0
    if mode == "i2v":
        clip = read("image_encoder")
        clip = clip.get("vision_config", clip)
        image_dim = int(clip["hidden_size"])
        image_tokens = (int(clip["image_size"]) // int(clip["patch_size"])) ** 2 + 1
    return ConditionConfigs(
        vae=vae, schedule=schedule, text_dim=int(read("text_encoder")["d_model"]), image_dim=image_dim,
        image_tokens=image_tokens, temporal_compression=int(vae["scale_factor_temporal"]),
        spatial_compression=int(vae["scale_factor_spatial"]),
    )  # fmt: skip


def compatibility(
    values: Mapping[str, Any], cond: ConditionConfigs, *, mode: str, max_sequence_length: int
) -> list[Mismatch]:
    """The settings of the ``WanTransformer3DModel`` config ``values`` (and the prompt length) that do not fit
    the condition side ``cond``: channels and context widths must be those the condition models produce.

    Returns:
        one `Mismatch` per misfit, in a fixed order; empty when the transformer fits.
    """
    z_dim = int(cond.vae["z_dim"])
    # I2V inputs are the noised latents, the first-frame mask (one channel per frame the VAE folds into a latent
    # frame) and the first frame's latents, stacked on channels.
    want_in = z_dim if mode == "t2v" else 2 * z_dim + cond.temporal_compression
    checks = [
        ("in_channels", values.get("in_channels"), want_in, f"the VAE's z_dim {z_dim} (mode {mode})"),
        ("out_channels", values.get("out_channels"), z_dim, f"the VAE's z_dim {z_dim}"),
        ("text_dim", values.get("text_dim"), cond.text_dim, "the text encoder's d_model"),
    ]
    if cond.image_dim is not None:
        checks.append(
            ("image_dim", values.get("image_dim"), cond.image_dim, "the CLIP image encoder's hidden_size")
        )
    if values.get("added_kv_proj_dim") is not None:
        # The image-conditioned cross-attention splits its context as [image tokens; the last 512 tokens as text]
        # (diffusers' WanAttnProcessor and ours): any other prompt length feeds CLIP tokens through the text
        # projections, or text tokens through the image ones, without an error.
        checks.append((
            "max_sequence_length", max_sequence_length, WAN_TEXT_CONTEXT_LEN,
            "Wan's image-conditioned cross-attention takes the last 512 context tokens as the prompt",
        ))  # fmt: skip
    return [Mismatch(key, found, want, why) for key, found, want, why in checks if found != want]


def weight_counts(model: nn.Module) -> WeightCounts:
    """``model``'s (a ``WanTransformer3DModel``, on meta or not) matrices by what they multiply: text context
    (the text embedder, the cross-attention's keys and values), image context (the CLIP embedder, the I2V
    cross-attention's added keys and values), once per sample (the timestep embedding), each video token (the
    rest); vectors and the modulation tables (``scale_shift_table``) are not matmul weights."""
    counts = {"token": 0, "text": 0, "image": 0, "sample": 0}
    for name, param in model.named_parameters():
        if param.dim() < 2 or "scale_shift_table" in name:
            continue
        dotted = f".{name}"
        if any(k in dotted or name.startswith(k) for k in _TEXT_PARAMS):
            counts["text"] += param.numel()
        elif any(k in dotted or name.startswith(k) for k in _IMAGE_PARAMS):
            counts["image"] += param.numel()
        elif any(name.startswith(k) for k in _SAMPLE_PARAMS):
            counts["sample"] += param.numel()
        else:
            counts["token"] += param.numel()
    config = model.config
    return WeightCounts(
        **counts,
        layers=int(config.num_layers),
        width=int(config.num_attention_heads * config.attention_head_dim),
    )
