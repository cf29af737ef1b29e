"""Vision-language (``model.task: vlm``) and omni-thinker (``model.task: omni``) training: `TextTask` plus the
encoder towers' inputs. How rows are laid out for a model (its position rule, video layout, encoder kind) is
declared by its family (`veomni.models.family.DataRules`), looked up by ``model_type``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.models.families import data_rules
from veomni.models.family import DataRules
from veomni.models.multimodal.collate import model_keys
from veomni.train.data import Step
from veomni.train.flops import (
    attention_layers,
    flops_per_token,
    query_width,
    sliding_window_layers,
    text_config,
    vision_flops_per_patch,
)
from veomni.train.tasks import TaskSetup
from veomni.train.tasks.text import TextTask, prepare_transformers_task

if TYPE_CHECKING:
    from veomni.train.recipe import Recipe


def vision_tower(probe: nn.Module) -> nn.Module:
    """The vision encoder of a VLM (``model.visual`` of transformers' image-text-to-text classes)."""
    inner = getattr(probe, "model", probe)
    visual = getattr(inner, "visual", None)
    if visual is None:
        raise ValueError(
            f"model.task=vlm needs a vision-language model with a `model.visual` tower; {type(probe).__name__} "
            "has none"
        )
    return visual


@attrs.frozen(kw_only=True)
class VlmTask(TextTask):
    """Image-text-to-text training (``data.kind: multimodal``): `TextTask` plus the vision inputs.

    The batch (`veomni.train.data.multimodal_batch.collate_multimodal`, laid out by the collate table
    `veomni.models.multimodal.collate.VISION_COLLATE`) carries 4-row mrope ``position_ids`` (this SP rank's slice), the
    full micro-batch's ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` on
    every SP rank (the model slices the tower's input itself), or None for a modality the micro-batch lacks (the
    model runs its dummy tower forward where collectives need it).

    Attributes:
        vision_flops_per_patch: `vision_flops_per_patch` of the tower (the LM term excludes the tower).
        collate_metadata: the model's picklable host-side vision layout (its ``vision_collate_metadata()``, e.g.
            Qwen2.5-VL's `veomni.models.qwen2_5_vl.window.WindowIndex`), run by the collator per micro-batch and
            passed to the model as ``vision_metadata``; None for models whose tower needs none.
        data_rules: how the data pipeline lays out this model's rows, from its family's declaration
            (`veomni.models.families.data_rules`); None for a model no veomni family declares (its rows are then
            refused with the reason).
        model_config: the model config (the data pipeline reads token ids and position settings from it).
    """

    vision_flops_per_patch: float
    collate_metadata: Callable[..., Any] | None = None
    data_rules: DataRules | None = None
    model_config: Any = None
    name: ClassVar[str] = "vlm"
    model_task: ClassVar[str] = "image_text_to_text"
    data_kinds: ClassVar[tuple[str, ...]] = ("multimodal",)

    @classmethod
    def prepare(cls, recipe: Recipe, state: ParallelState, device: torch.device) -> TaskSetup:
        return prepare_transformers_task(cls, recipe, state, device)

    def data_options(self) -> dict[str, Any]:
        """The data pipeline's model-side inputs: the collator's vision layout (``vision_metadata``), the family's
        `DataRules` and the model config."""
        return {
            "vision_metadata": self.collate_metadata,
            "data_rules": self.data_rules,
            "model_config": self.model_config,
        }

    @classmethod
    def towers(cls, probe: nn.Module) -> tuple[nn.Module, ...]:
        """The encoder towers of ``probe`` whose weights are left out of the per-token FLOPs: the vision tower."""
        return (vision_tower(probe),)

    @classmethod
    def for_model(cls, probe: nn.Module) -> VlmTask:
        visual = vision_tower(probe)
        text = text_config(probe.config)
        merge = int(probe.config.vision_config.spatial_merge_size)
        vision = vision_flops_per_patch(visual, merge)
        # The towers' weights are counted per patch (or not yet, the audio tower's), not per text token.
        tower = {id(p) for module in cls.towers(probe) for p in module.parameters()}
        in_tower = {name for name, p in probe.named_parameters() if id(p) in tower}
        window_layers, window = sliding_window_layers(probe.config)
        return cls(
            flops_per_token=flops_per_token(probe, lambda name: name not in in_tower),
            num_layers=attention_layers(probe.config),
            query_width=query_width(probe.config),
            aux_loss_coef=float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0),
            window_layers=window_layers,
            window=window,
            vision_flops_per_patch=vision,
            collate_metadata=probe.vision_collate_metadata()
            if hasattr(probe, "vision_collate_metadata")
            else None,
            data_rules=data_rules(probe.config.model_type),
            model_config=probe.config,
        )

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        kwargs = super().model_kwargs(batch, device, num_items)
        for key in model_keys():  # position_ids included: already moved, moving it again is a no-op
            value = batch.get(key)
            kwargs[key] = None if value is None else value.to(device, non_blocking=True)
        if self.collate_metadata is not None:
            tables = batch.get("vision_metadata") or {}
            kwargs["vision_metadata"] = {
                k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in tables.items()
            }
        return kwargs

    def save_side_files(self, out: Path, tokenizer: Any) -> None:
        """Tokenizer (with its chat template) and the image processor (``preprocessor_config.json``), plus the
        processor/video configs found beside the tokenizer, so that ``AutoModelForImageTextToText`` and
        ``AutoImageProcessor`` (``AutoProcessor`` where torchvision is installed) load the export."""
        import shutil

        from veomni.train.data.multimodal import load_image_processor

        source = Path(tokenizer.name_or_path)
        super().save_side_files(out, tokenizer)
        load_image_processor(str(source)).save_pretrained(out)
        for name in ("processor_config.json", "video_preprocessor_config.json", "chat_template.json"):
            if (source / name).is_file() and not (out / name).exists():
                shutil.copyfile(source / name, out / name)
        # A processor template other than the one trained with (data.chat_template replaced it on the tokenizer,
        # which wrote chat_template.jinja) would make AutoProcessor chat differently from training: leave it out.
        processor_template = out / "chat_template.json"
        if processor_template.is_file():
            saved = json.loads(processor_template.read_text()).get("chat_template")
            if saved != tokenizer.chat_template:
                processor_template.unlink()

    def step_flops(self, step: Step) -> float:
        return super().step_flops(step) + self.vision_flops_per_patch * step.patches


OMNI_KEYS = ("input_features", "feature_attention_mask", "video_second_per_grid")
"""Audio tensors and the videos' seconds per grid of an omni micro-batch
(`veomni.train.data.audio_visual.AudioVisualMediaSample.collate_extra`)."""


@attrs.frozen(kw_only=True)
class OmniTask(VlmTask):
    """Omni thinker training (Qwen2.5-Omni: text, images, videos (optionally with their audio tracks) and audio in,
    text out; ``data.kind: multimodal``): `VlmTask` plus the micro-batch's audio clips, ``input_features`` float32
    ``[clips, mels, frames]`` and ``feature_attention_mask`` int64 ``[clips, frames]`` (`veomni.train.data.audio_visual`),
    both None without audio (the thinker then runs its audio tower's dummy forward), and ``video_second_per_grid``
    float32 ``[videos]`` (None without videos; the host-side positions already hold it). The audio tower's weights
    are excluded from the per-token FLOPs; its own FLOPs (per mel frame) are not counted yet.

    """

    name: ClassVar[str] = "omni"
    model_task: ClassVar[str] = "any_to_any"

    @classmethod
    def towers(cls, probe: nn.Module) -> tuple[nn.Module, ...]:
        """The vision and the audio tower of ``probe`` (left out of the per-token FLOPs)."""
        audio = getattr(getattr(probe, "model", probe), "audio_tower", None)
        if audio is None:
            raise ValueError(
                f"model.task=omni needs an omni thinker with a `model.audio_tower`; {type(probe).__name__} has none"
            )
        return (*super().towers(probe), audio)

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        kwargs = super().model_kwargs(batch, device, num_items)
        for key in OMNI_KEYS:
            value = batch.get(key)
            kwargs[key] = None if value is None else value.to(device, non_blocking=True)
        tables = batch.get("audio_metadata")
        if (
            tables is not None
        ):  # only models with a host-side audio layout get one (``DataRules.audio_layout``)
            kwargs["audio_metadata"] = {
                k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in tables.items()
            }
        return kwargs

    def save_side_files(self, out: Path, tokenizer: Any) -> None:
        """As `VlmTask.save_side_files`, then the source's ``preprocessor_config.json`` over the image processor's:
        the thinker's holds the image processor and the audio feature extractor in one file."""
        import shutil

        super().save_side_files(out, tokenizer)
        source = Path(tokenizer.name_or_path) / "preprocessor_config.json"
        if source.is_file():
            shutil.copyfile(source, out / "preprocessor_config.json")
