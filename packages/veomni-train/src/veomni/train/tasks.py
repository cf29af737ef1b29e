"""Training tasks: what the loop asks of a model family, so that the loop itself never branches on model type.

A task turns a packed batch into the model's keyword arguments, the model's outputs into the loss the loop
back-propagates, a step into its FLOPs, and a finished model into an export. ``text`` (causal language modelling
on packed documents) is the first; vision-language, omni and diffusion tasks implement the same protocol.

Everything read from the model config goes through ``config.get_text_config()``: a composite model (a VLM, an
omni thinker) keeps its language model's settings -- layers, heads, MoE router coefficient -- in a sub-config,
and reading them from the root would silently drop them (the aux loss coefficient of a VLM-MoE, say).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from veomni.core.parallel_state import ParallelState
from veomni.models.qwen2_vl.positions import Qwen2VLPositions
from veomni.models.qwen3_vl.collate import model_keys
from veomni.train.data import Step, model_inputs
from veomni.train.dit_task import DitTask
from veomni.train.flops import (
    attention_layers,
    flops_per_token,
    query_width,
    sliding_window_layers,
    text_config,
    vision_flops_per_patch,
)
from veomni.train.metrics import attention_flops

IGNORE_INDEX = -100


class Task(Protocol):
    """The seams of one training task (see the module docstring).

    Attributes:
        name: the recipe's ``model.task`` value.
        model_task: the registry task whose class is built (``causal_lm``, ``image_text_to_text``, ...).
        aux_loss_coef: weight of the model's auxiliary (MoE load-balancing) loss; 0 when it has none.
    """

    name: str
    model_task: str
    aux_loss_coef: float

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        """The keyword arguments of ``model(**kwargs)`` for one micro-batch; ``num_items`` (0-d int64) is the
        loss normaliser: the model returns its token-loss sum over it."""
        ...

    def forward(
        self, model: nn.Module, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> Any:
        """Run ``model`` on one micro-batch (usually ``model(**self.model_kwargs(...))``); the outputs go to `loss`."""
        ...

    def trained_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Trained positions of one micro-batch on this rank, a 0-d int64 tensor (evaluation's denominator)."""
        ...

    def loss(self, outputs: Any, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reported, objective)`` from the model's outputs: the 0-d loss that is logged, and the 0-d term that
        is back-propagated (the reported loss plus ``aux_loss_coef * aux_scale`` times the auxiliary loss)."""
        ...

    def export(self, model: nn.Module, out: Path, tokenizer: Any, parallel_state: ParallelState) -> None:
        """Write the trained model to ``out`` in its upstream format (every rank calls it)."""
        ...

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        """Write into ``out`` what `export` writes beside the weights (config, generation config, tokenizer,
        processor files), for a checkpoint's ``hf_files/`` (`veomni.models.export_files`); called on one rank,
        so no collectives. Nothing where the offline export does not read them."""
        ...

    def step_flops(self, step: Step) -> float:
        """Useful training FLOPs of a whole step over all ranks (the MFU numerator, `veomni.train.metrics`)."""
        ...


@attrs.frozen(kw_only=True)
class TextTask:
    """Causal language modelling on packed documents (labels pre-shifted per document by the collator).

    Attributes:
        flops_per_token: `flops_per_token` of the model.
        num_layers: `attention_layers` of the model (attention FLOPs term).
        query_width: `query_width` of the model.
        aux_loss_coef: the model's ``router_aux_loss_coef`` (0 without one); the loop adds the aux term.
        window_layers, window: `sliding_window_layers` of the model (their attention FLOPs stop growing
            quadratically at the window).
    """

    flops_per_token: float
    num_layers: int
    query_width: float
    aux_loss_coef: float = 0.0
    window_layers: int = 0
    window: int | None = None
    name: ClassVar[str] = "text"
    model_task: ClassVar[str] = "causal_lm"

    @classmethod
    def for_model(cls, probe: nn.Module) -> TextTask:
        """The task for ``probe`` (a meta instance of the model class that will be trained)."""
        text = text_config(probe.config)
        window_layers, window = sliding_window_layers(probe.config)
        return cls(
            flops_per_token=flops_per_token(probe),
            num_layers=attention_layers(probe.config),
            query_width=query_width(probe.config),
            aux_loss_coef=float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0),
            window_layers=window_layers,
            window=window,
        )

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        kwargs = model_inputs(dict(batch), device)
        shifted = batch["labels"].to(device, non_blocking=True)
        # Both: HF computes a loss only when ``labels`` is given, and then takes ``shift_labels`` (already aligned
        # per packed document) over shifting ``labels`` itself; veomni's fused path reads the same pair.
        kwargs["labels"] = kwargs["shift_labels"] = shifted
        kwargs["num_items_in_batch"] = num_items
        # No KV cache in training: HF would otherwise fill one per forward (memory), and a checkpointed layer's
        # recomputation would append its keys a second time.
        kwargs["use_cache"] = False
        if self.aux_loss_coef:
            kwargs["output_router_logits"] = True
        return kwargs

    def forward(
        self, model: nn.Module, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> Any:
        return model(**self.model_kwargs(batch, device, num_items))

    def trained_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def loss(self, outputs: Any, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        loss = outputs.loss
        aux = getattr(outputs, "aux_loss", None)
        if self.aux_loss_coef and aux is not None:
            return loss, loss + self.aux_loss_coef * aux_scale * aux
        return loss, loss

    def export(self, model: nn.Module, out: Path, tokenizer: Any, parallel_state: ParallelState) -> None:
        from veomni.models.export import export_hf

        export_hf(model, out, parallel_state=parallel_state)
        if dist.get_rank() == 0:
            self.save_side_files(out, tokenizer)
        dist.barrier()

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        """`export`'s files but the weights: the same two calls, so the offline export of the checkpoint
        (`veomni.models.export.export_dcp_to_hf`) writes what `export` writes."""
        from veomni.models.export_files import save_model_files

        save_model_files(model, out)
        self.save_side_files(out, tokenizer)

    def save_side_files(self, out: Path, tokenizer: Any) -> None:
        """The tokenizer / processor files beside an export's config (one rank, after ``generation_config.json``
        is written: `save_tokenizer` completes it)."""
        save_tokenizer(out, tokenizer)

    def step_flops(self, step: Step) -> float:
        # Both terms over the whole step, all DP ranks (the loop divides by the world size): the samples' lengths
        # come from the plan, not from this rank's cu_seqlens.
        return (
            self.flops_per_token * step.tokens
            + attention_flops(step.sample_tokens, self.num_layers, self.query_width)
            + attention_flops(step.sample_tokens, self.window_layers, self.query_width, window=self.window)
        )


def save_tokenizer(out: Path, tokenizer: Any) -> None:
    """Save ``tokenizer`` beside an export and give the export's ``generation_config.json`` the tokenizer's end
    and pad tokens where the model config had none, so ``generate()`` on the export stops at the end of a turn.

    Composite configs of transformers 5.23 (Qwen3-VL's) carry no ``eos_token_id``, so the generation config
    `export_hf` derives from them has none either; the tokenizer we trained with knows it.
    """
    from transformers import GenerationConfig

    tokenizer.save_pretrained(out)
    if not (out / "generation_config.json").is_file():
        return  # not a generating model
    generation = GenerationConfig.from_pretrained(out)
    changed = False
    for field in ("eos_token_id", "pad_token_id"):
        if getattr(generation, field) is None and getattr(tokenizer, field, None) is not None:
            setattr(generation, field, getattr(tokenizer, field))
            changed = True
    if changed:
        generation.save_pretrained(out)


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


VIDEO_LAYOUTS = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
"""Model types whose video placeholders and positions the data pipeline writes (`veomni.models.qwen3_vl.video`;
Qwen3.5's processor is transformers' ``Qwen3VLProcessor`` and its ``get_rope_index`` Qwen3-VL's)."""

QWEN2_VL_LAYOUTS = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Model types whose rows the data pipeline writes in the Qwen2-VL layout, images and videos
(`veomni.train.data.qwen2_vl`), with the model's own position rule (`veomni.models.qwen2_vl.positions`)."""


def data_positions(config: PretrainedConfig) -> Qwen2VLPositions | None:
    """The model's own position rule that the data pipeline must use (`VlmTask.positions`), or None where it uses
    Qwen3-VL's (built from the tokenizer)."""
    return Qwen2VLPositions.from_config(config) if config.model_type in QWEN2_VL_LAYOUTS else None


@attrs.frozen(kw_only=True)
class VlmTask(TextTask):
    """Image-text-to-text training (``data.kind: multimodal``): `TextTask` plus the vision inputs.

    The batch (`veomni.train.data.multimodal_batch.collate_multimodal`, laid out by the model's collate table
    `veomni.models.qwen3_vl.collate.COLLATE`) carries 4-row mrope ``position_ids`` (this SP rank's slice), the
    full micro-batch's ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` on
    every SP rank (the model slices the tower's input itself), or None for a modality the micro-batch lacks (the
    model runs its dummy tower forward where collectives need it).

    Attributes:
        vision_flops_per_patch: `vision_flops_per_patch` of the tower (the LM term excludes the tower).
        collate_metadata: the model's picklable host-side vision layout (its ``vision_collate_metadata()``, e.g.
            Qwen2.5-VL's `veomni.models.qwen2_5_vl.window.WindowIndex`), run by the collator per micro-batch and
            passed to the model as ``vision_metadata``; None for models whose tower needs none.
        no_video: None when the data pipeline writes this model's video placeholders and positions (Qwen3-VL's
            layout: `veomni.models.qwen3_vl.video`; Qwen2-VL's: `veomni.train.data.qwen2_vl`), else why rows with
            videos are refused.
        positions: for the Qwen2-VL family (`QWEN2_VL_LAYOUTS`), the model's picklable mrope rule from its config
            (`veomni.models.qwen2_vl.positions.Qwen2VLPositions`; Qwen2.5-VL's video time axis needs
            ``tokens_per_second``); the data pipeline then writes the Qwen2-VL layout. None: Qwen3-VL's layout.
    """

    vision_flops_per_patch: float
    collate_metadata: Callable[..., Any] | None = None
    no_video: str | None = None
    positions: Qwen2VLPositions | None = None
    name: ClassVar[str] = "vlm"
    model_task: ClassVar[str] = "image_text_to_text"

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
            no_video=None
            if probe.config.model_type in VIDEO_LAYOUTS | QWEN2_VL_LAYOUTS
            else (
                f"model_type {probe.config.model_type!r}: the data pipeline writes Qwen3-VL's video layout (one "
                "placeholder run per temporal patch behind a timestamp), which this model does not read; video "
                f"rows are supported for {sorted(VIDEO_LAYOUTS | QWEN2_VL_LAYOUTS)}"
            ),
            positions=data_positions(probe.config),
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
(`veomni.train.data.omni.OmniMediaSample.collate_extra`)."""


@attrs.frozen(kw_only=True)
class OmniTask(VlmTask):
    """Omni thinker training (Qwen2.5-Omni: text, images, videos (optionally with their audio tracks) and audio in,
    text out; ``data.kind: multimodal``): `VlmTask` plus the micro-batch's audio clips, ``input_features`` float32
    ``[clips, mels, frames]`` and ``feature_attention_mask`` int64 ``[clips, frames]`` (`veomni.train.data.omni`),
    both None without audio (the thinker then runs its audio tower's dummy forward), and ``video_second_per_grid``
    float32 ``[videos]`` (None without videos; the host-side positions already hold it). The audio tower's weights
    are excluded from the per-token FLOPs; its own FLOPs (per mel frame) are not counted yet.

    Attributes:
        thinker_config: the model config, for the data pipeline's token ids and positions
            (`veomni.train.data.omni.OmniEncoder`).
    """

    thinker_config: Any = None
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

    @classmethod
    def for_model(cls, probe: nn.Module) -> OmniTask:
        # The omni data pipeline writes the thinker's own video layout (`veomni.train.data.omni`).
        return attrs.evolve(super().for_model(probe), thinker_config=probe.config, no_video=None)

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        kwargs = super().model_kwargs(batch, device, num_items)
        for key in OMNI_KEYS:
            value = batch.get(key)
            kwargs[key] = None if value is None else value.to(device, non_blocking=True)
        tables = batch.get("audio_metadata")
        if tables is not None:  # only thinkers with a host-side audio layout get one (`AUDIO_LAYOUTS`)
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


TASKS = {"text": TextTask, "vlm": VlmTask, "dit": DitTask, "omni": OmniTask}
"""Recipe ``model.task`` name -> task class (each has ``for_model(probe)``)."""


def build_task(name: str, probe: nn.Module) -> Task:
    """The task ``name`` for the model ``probe`` (a meta instance); an unknown name lists the known ones."""
    if name not in TASKS:
        raise ValueError(f"model.task: expected one of {sorted(TASKS)}, found {name!r}")
    return TASKS[name].for_model(probe)
