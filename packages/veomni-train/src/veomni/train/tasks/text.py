"""Causal language modelling on packed documents (``model.task: text``), and the setup every transformers task
shares (`prepare_transformers_task`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.train.data import Step, model_inputs
from veomni.train.flops import (
    attention_layers,
    flops_per_token,
    query_width,
    sliding_window_layers,
    text_config,
)
from veomni.train.metrics import attention_flops
from veomni.train.tasks import TaskSetup

if TYPE_CHECKING:
    from veomni.train.recipe import Recipe

IGNORE_INDEX = -100


def prepare_transformers_task(
    cls: type, recipe: Recipe, state: ParallelState, device: torch.device
) -> TaskSetup:
    """The `TaskSetup` of a transformers task class ``cls`` (text, vlm, omni, a user's): the tokenizer, the config
    and every check that needs no model, a meta probe of the registry's class for ``cls.model_task``, the task
    (``cls.for_model(probe)``) and the packed train / eval data (with the task's ``data_options()``)."""
    from veomni.models.registry import MODELS
    from veomni.train.data import DataTopology, build_eval_data, build_train_data, load_tokenizer
    from veomni.train.model_setup import _hardware, meta_instance, model_config
    from veomni.train.preflight import (
        check_ops_backend,
        check_parallel_fit,
        check_sp_heads,
        check_trainable,
        check_vocab,
    )

    tokenizer = load_tokenizer(recipe.model.tokenizer_path, recipe.data.chat_template)
    config = model_config(recipe)
    check_vocab(tokenizer, config, recipe.model.tokenizer_path)
    check_sp_heads(config, state.dims.sp)
    check_ops_backend(recipe)
    ops = recipe.ops.to_ops_config(hardware=_hardware(device))
    probe = meta_instance(config, cls.model_task)  # type: ignore[attr-defined]
    check_trainable(probe, recipe.model.freeze, recipe.optim.lr_multipliers)
    fast_paths = MODELS.model_class(MODELS.load_config(config), cls.model_task).fast_paths  # type: ignore[attr-defined]
    check_parallel_fit(probe, fast_paths, backend=recipe.model.backend, sp=state.dims.sp, ep=state.dims.ep)
    task = cls.for_model(probe)  # type: ignore[attr-defined]
    topology = DataTopology.from_parallel_state(state)
    # Tokenising the index is split over all ranks (each then holds the whole index).
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    options = task.data_options()
    pin = device.type == "cuda"
    train_data = build_train_data(recipe, tokenizer, topology, group=group, pin_memory=pin, **options)
    eval_data = build_eval_data(recipe, tokenizer, topology, group=group, pin_memory=pin, **options)
    return TaskSetup(
        tokenizer=tokenizer, config=config, probe=probe, ops=ops, task=task, train_data=train_data,
        eval_data=eval_data,
    )  # fmt: skip


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
    data_kinds: ClassVar[tuple[str, ...]] = ("text", "conversation")

    @classmethod
    def prepare(cls, recipe: Recipe, state: ParallelState, device: torch.device) -> TaskSetup:
        """`TaskSetup` of a transformers task: tokenizer, config and kernel checks, the meta probe, packed data
        (with the task's `data_options`)."""
        return prepare_transformers_task(cls, recipe, state, device)

    def data_options(self) -> dict[str, Any]:
        """Keyword arguments of `veomni.train.data.build_train_data` / ``build_eval_data`` beyond the recipe's
        data section: none for text."""
        return {}

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
        from veomni.models.export.hf import export_hf

        export_hf(model, out, parallel_state=parallel_state)
        if dist.get_rank() == 0:
            self.save_side_files(out, tokenizer)
        dist.barrier()

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        """`export`'s files but the weights: the same two calls, so the offline export of the checkpoint
        (`veomni.models.export.export_dcp_to_hf`) writes what `export` writes."""
        from veomni.models.export.files import save_model_files

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


