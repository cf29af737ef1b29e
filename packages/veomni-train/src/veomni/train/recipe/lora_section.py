"""The ``lora:`` recipe section: parameter-efficient fine-tuning with LoRA adapters (`veomni.models.lora`)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from veomni.train.recipe.parse import RecipeError

LORA_MEANING = ("rank", "alpha", "use_rslora", "targets", "exclude", "modules_to_save")
"""The fields that decide what the adapter weights are: a resume must keep them (`check_resumable`)."""


def _field(default: Any, help: str, *, path: bool = False, factory: bool = False) -> Any:
    meta = {"help": help, "path": path}
    return (
        attrs.field(factory=default, metadata=meta)
        if factory
        else attrs.field(default=default, metadata=meta)
    )


@attrs.frozen(kw_only=True)
class LoraSection:
    enabled: bool = _field(
        False,
        "train LoRA adapters on a frozen base instead of every weight (the base stays in model.dtype, with no fp32 "
        "master copy); every other lora.* key needs this",
    )
    rank: int = _field(16, "r: the inner dimension of each adapter's B @ A")
    alpha: float = _field(
        32.0, "the adapter output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)"
    )
    dropout: float = _field(0.0, "dropout on the adapters' input while training (0: none)")
    targets: tuple[str, ...] = _field(
        (),
        "what to adapt: the family's target groups (attention, linear_attention, mlp, shared_experts; experts for "
        "MoE models: per-expert adapters on the fused experts, needs dropout 0; vision, merger, audio for VLM/omni "
        "models), module FQN globs (model.layers.*.self_attn.q_proj, model.layers.*.mlp.experts), or leaf names "
        "(q_proj, as PEFT's target_modules); empty: the family's default groups",
    )
    exclude: tuple[str, ...] = _field((), "FQN globs or leaf names taken out of what lora.targets selects")
    modules_to_save: tuple[str, ...] = _field(
        (),
        "modules trained in full beside the adapters and saved in the adapter file (lm_head, model.embed_tokens); "
        "not for tied embeddings",
    )
    use_rslora: bool = _field(False, "rank-stabilised scaling alpha / sqrt(rank)")
    init: Literal["default", "gaussian", "zeros"] = _field(
        "default", "A's init (B starts at zero so training starts at the base model): default (Kaiming-uniform, "
        "PEFT's default) or gaussian (N(0, 1/rank)); zeros sets both to zero"
    )  # fmt: skip
    init_from: str | None = _field(
        None,
        "a PEFT adapter directory to start from (its rank, alpha and scaling rule must equal these)",
        path=True,
    )
    export: Literal["both", "adapter", "merged"] = _field(
        "both",
        "what an HF export writes: the PEFT adapter (<export>_adapter/: adapter_config.json + "
        "adapter_model.safetensors, for peft.PeftModel.from_pretrained), the merged model (<export>/: W + "
        "scaling * B @ A in the base checkpoint's layout), or both",
    )

    def __attrs_post_init__(self) -> None:
        if self.enabled:
            self.spec()  # LoraSpec validates rank, alpha, dropout, init
            return
        set_here = [f.name for f in attrs.fields(LoraSection) if getattr(self, f.name) != f.default]
        if set_here:
            raise RecipeError(
                f"lora: {['lora.' + n for n in set_here]} set but lora.enabled is false; set lora.enabled: true to "
                "train adapters, or remove them"
            )

    def spec(self) -> Any:
        """The `veomni.models.lora.LoraSpec` of this section."""
        from veomni.models.lora import LoraSpec

        try:
            return LoraSpec(
                rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=self.targets, exclude=self.exclude,
                modules_to_save=self.modules_to_save, use_rslora=self.use_rslora, init=self.init,
                init_from=self.init_from,
            )  # fmt: skip
        except (TypeError, ValueError) as err:
            raise RecipeError(str(err)) from err
