"""The declaration of a model family: one frozen object per family folder says everything about the family.

A family folder (``veomni/models/<family>/``) holds its patch configs, generated modeling and helpers, and a
``family.py`` whose ``FAMILY`` is a `ModelFamily`. Everything outside the folder asks that object: the model registry
(config class and ``{task: class}`` per ``model_type``, fast paths), ``patchgen --list/--check`` (patch configs), the
data pipeline (`DataRules`: how rows are laid out for the model) and the trainer (`TrainingHooks`). The list of
family modules is `veomni.models.families.FAMILY_MODULES`.

Every reference is a ``"package.module:attribute"`` string, resolved on first use: declaring a family imports
nothing but this module, so a text run never imports a VLM's or a DiT's code, and a broken adapter only fails the
model that uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


def _target(value: str, where: str) -> str:
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        raise ValueError(f"{where}: expected a 'package.module:attribute' string, got {value!r}")
    return value


def _optional_target(where: str):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value is not None:
            _target(value, f"{where}.{attribute.name}")  # type: ignore[arg-type]

    return check


def _required_target(where: str):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        _target(value, f"{where}.{attribute.name}")  # type: ignore[arg-type]

    return check


@attrs.frozen(kw_only=True)
class DataRules:
    """How the data pipeline lays out rows for one multimodal ``model_type``.

    The data pipeline knows no family: it picks its row encoder by ``encoder`` (a concept name) and builds the
    model's rules by resolving these targets with the model config.

    Attributes:
        encoder: the multimodal encoder kind (`veomni.train.data.encoders.ENCODER_KINDS`): ``"vision"`` (images and
            videos, each temporal patch of a clip written as its own timestamped run, Qwen3-VL's layout),
            ``"vision_untimed_video"`` (one placeholder run per clip, Qwen2-VL's layout) or ``"audio_visual"``
            (an omni thinker: images, videos, audio parts, videos' audio tracks).
        positions: ``"module:callable"``: ``callable(config)`` (``"audio_visual"``: ``callable(config,
            use_audio_in_video=bool)``) returns the picklable mrope position rule for this model (``config`` the
            model's config). The rule is called per row with ``(ids, image_grid_thw, video_grid_thw)``, plus
            ``second_per_grid`` for ``"vision_untimed_video"``, plus ``(audio_frames, second_per_grid)`` for
            ``"audio_visual"``, and returns int64 ``[3, n]``.
        video_rule: ``"module:callable"``: ``callable(path, config, fps=, max_frames=, frame_pixels=)`` returns the
            model's video sampling rule from the processor files at ``path`` (raising OSError or ValueError when
            they cannot be used); None: videos are not supported (``no_video`` says why).
        no_video: why rows with a video are refused, where ``video_rule`` is None.
        audio_tokens: ``"module:callable"``: ``callable(frames) -> int``, the LLM tokens of one audio clip of
            ``frames`` mel frames (the ``"audio_visual"`` encoder needs it).
        audio_layout: ``"module:callable"``: ``callable(config)`` returns the audio tower's picklable host-side
            chunk layout (called per micro-batch as ``layout(frames, padded_frames)``, its tables handed to the
            model as ``audio_metadata``); None: the tower derives its layout on the device.
    """

    encoder: str
    positions: str | None = attrs.field(default=None, validator=_optional_target("DataRules"))
    video_rule: str | None = attrs.field(default=None, validator=_optional_target("DataRules"))
    no_video: str | None = None
    audio_tokens: str | None = attrs.field(default=None, validator=_optional_target("DataRules"))
    audio_layout: str | None = attrs.field(default=None, validator=_optional_target("DataRules"))

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.encoder, str) or not self.encoder:
            raise ValueError(f"DataRules.encoder: expected an encoder kind name, got {self.encoder!r}")
        if self.positions is None:
            raise ValueError(
                f"DataRules(encoder={self.encoder!r}): a multimodal model declares its position rule"
            )
        if (self.video_rule is None) == (self.no_video is None):
            raise ValueError(
                f"DataRules(encoder={self.encoder!r}): give either video_rule or no_video (why videos are refused), "
                f"found video_rule={self.video_rule!r}, no_video={self.no_video!r}"
            )


@attrs.frozen(kw_only=True)
class TrainingHooks:
    """What the trainer calls on a family's model beyond the task's forward and loss.

    Attributes:
        balanced_routers: ``"module:callable"``: ``callable(model) -> list[nn.Module]`` attaches a load counter to
            every router with an auxiliary-loss-free correction bias and returns those routers
            (`veomni.models.moe.aux_free_balance`); None: the family has no such routers, and
            ``optim.moe_bias_update_speed`` is refused for it.
    """

    balanced_routers: str | None = attrs.field(default=None, validator=_optional_target("TrainingHooks"))


@attrs.frozen(kw_only=True)
class DiffusionRules:
    """What veomni asks of a diffusion transformer (a diffusers ``_class_name``) beyond its class: the hooks the
    diffusers build applies (`veomni.models.diffusers.build`) and the condition side the ``dit`` task trains it
    with (`veomni.train.tasks.dit`). Every entry is a ``"module:attribute"`` string, resolved on first use.

    Model side:
        bind_kernels: ``callable(model, ops)`` routes the model's attention, q/k norms and rotary through the
            kernels of ``ops`` (a `veomni.kernels.OpsConfig`); None: ``ops`` is refused for this model.
        sequence_parallel: ``callable(model, state)`` makes the model Ulysses sequence-parallel over
            ``state.sp_group`` (refusing a head count it cannot split); None: ``sp > 1`` is refused.

    Condition side:
        condition_config: the noising config class, built as ``Class(mode=, max_sequence_length=,
            latent_sample_mode=, prompt_dropout_prob=, shift=)`` (the recipe's ``dit`` section).
        condition_model: the frozen condition models: ``Class.from_pretrained(root, condition_config, device=,
            text_encoder_dtype=, init=, seed=)``, an instance having ``tokenizer``, ``get_condition(captions,
            videos)`` and ``empty_prompt_embeds()``.
        condition_error: the exception class the condition side raises for a bad condition directory (bad input:
            the trainer reports its message without a traceback).
        modes: ``{mode: what it conditions on}``, the condition modes the family trains (the recipe's ``dit.mode``;
            the first is the default, `condition_mode`); every ``mode`` argument below is one of them.
        condition_configs: ``callable(root, mode, shift)`` returns the condition side read from its configs alone
            (`veomni.models.diffusers.rules.ConditionConfigs`): no model is built.
        compatibility: ``callable(values, cond, mode=, max_sequence_length=)`` returns the transformer config
            ``values`` (and the prompt length) that do not fit the condition side ``cond``, as
            `veomni.models.diffusers.rules.Mismatch` entries; empty when they fit.
        flow_matching_inputs: ``callable(condition, vae_config=, schedule=, generator=, latent_sample_mode=,
            prompt_dropout_prob=, empty_prompt_embeds=)`` turns one micro-batch's conditions into the
            transformer's noised inputs and the velocity target (per-sample lists keyed by the forward's
            arguments, plus ``training_target``).
        weight_counts: ``callable(model)`` returns the transformer's matmul weights by what each multiplies (video
            tokens, text or image context tokens, once per sample) and its attention shape
            (`veomni.models.diffusers.rules.WeightCounts`), for the task's FLOPs count; ``model`` may be on meta.
    """

    bind_kernels: str | None = attrs.field(default=None, validator=_optional_target("DiffusionRules"))
    sequence_parallel: str | None = attrs.field(default=None, validator=_optional_target("DiffusionRules"))
    condition_config: str = attrs.field(validator=_required_target("DiffusionRules"))
    condition_model: str = attrs.field(validator=_required_target("DiffusionRules"))
    condition_error: str = attrs.field(validator=_required_target("DiffusionRules"))
    condition_configs: str = attrs.field(validator=_required_target("DiffusionRules"))
    compatibility: str = attrs.field(validator=_required_target("DiffusionRules"))
    flow_matching_inputs: str = attrs.field(validator=_required_target("DiffusionRules"))
    weight_counts: str = attrs.field(validator=_required_target("DiffusionRules"))
    modes: Mapping[str, str] = attrs.field(converter=dict)

    def __attrs_post_init__(self) -> None:
        if not self.modes or not all(isinstance(m, str) and m for m in self.modes):
            raise ValueError(f"DiffusionRules.modes: expected {{mode name: description}}, got {self.modes!r}")

    def condition_mode(self, mode: str | None) -> str:
        """``mode`` checked against `modes`; None: the first (the family's default).

        Raises:
            ValueError: ``mode`` is not one of `modes` (the message lists them with what each conditions on).
        """
        if mode is None:
            return next(iter(self.modes))
        if mode not in self.modes:
            offered = "; ".join(f"{name}: {what}" for name, what in self.modes.items())
            raise ValueError(f"condition mode {mode!r} is not one this model trains ({offered})")
        return mode


@attrs.frozen(kw_only=True)
class LoraTargets:
    """Where LoRA adapters go in a model type (`veomni.models.lora`): named groups of module FQN globs.

    Attributes:
        groups: ``{group name: FQN globs}``; a recipe's ``lora.targets`` may name a group (``attention``, ``mlp``,
            ``experts``, ``vision``, ...). A glob selects the plain ``nn.Linear`` modules it matches (``*`` stays in
            one name component), or the fused projections of the MoE experts modules it matches (per-expert
            adapters, `veomni.models.lora.experts`); every group must select at least one in the model.
        default: the groups adapted when ``lora.targets`` is empty.
    """

    groups: Mapping[str, tuple[str, ...]] = attrs.field(
        converter=lambda g: {k: tuple(v) for k, v in g.items()}
    )
    default: tuple[str, ...] = attrs.field(default=("attention", "mlp"), converter=tuple)

    def __attrs_post_init__(self) -> None:
        unknown = [g for g in self.default if g not in self.groups]
        if unknown:
            raise ValueError(
                f"LoraTargets: default groups {unknown} are not among its groups {list(self.groups)}"
            )


STANDARD_LORA_GROUPS = {
    "attention": "self_attn.*proj*",
    "linear_attention": "linear_attn.*proj*",
    "mlp": "mlp.*_proj",
    "shared_experts": ("mlp.shared_expert.*_proj", "mlp.shared_experts.*_proj"),
}
"""Module globs relative to one decoder block, in the names transformers gives its decoders."""

EXPERTS_LORA_GROUP = "mlp.experts"
"""The ``experts`` group (`decoder_lora` with ``experts=True``): a decoder block's fused MoE experts in transformers'
SwiGLU layout, adapted per expert on both projections (PEFT's ``target_parameters``)."""

MOE_DEFAULT = ("attention", "linear_attention")
"""Default LoRA groups of the MoE model types PEFT re-targets on load (its transformers v4 -> v5 conversion maps any
``*.gate_proj/up_proj/down_proj`` layer onto the fused experts): the dense MLP and shared experts stay available by
name, but an adapter on them cannot be exported in PEFT's format (`veomni.models.lora.peft_format`)."""

LM_LAYERS = ("model.layers", "model.language_model.layers")
"""Where a causal LM's blocks are (text classes), and a VLM's (its language model)."""


def decoder_lora(
    layers: tuple[str, ...] = LM_LAYERS,
    *,
    default: tuple[str, ...] = tuple(STANDARD_LORA_GROUPS),
    extra: Mapping[str, tuple[str, ...]] | None = None,
    experts: bool = False,
) -> LoraTargets:
    """`LoraTargets` of a decoder whose blocks are ``<layers>.<i>``: the `STANDARD_LORA_GROUPS` under every prefix of
    ``layers`` (and, with ``experts``, the ``experts`` group: `EXPERTS_LORA_GROUP`), plus ``extra`` groups of
    whole-FQN globs (a vision tower: ``model.visual.blocks.*.attn.qkv``)."""
    standard = {**STANDARD_LORA_GROUPS, **({"experts": EXPERTS_LORA_GROUP} if experts else {})}
    groups: dict[str, tuple[str, ...]] = {}
    for name, rel in standard.items():
        rels = (rel,) if isinstance(rel, str) else rel
        groups[name] = tuple(f"{prefix}.*.{r}" for prefix in layers for r in rels)
    return LoraTargets(groups={**groups, **(extra or {})}, default=default)


VISION_LORA = {
    "vision": ("model.visual.blocks.*.attn.*", "model.visual.blocks.*.mlp.*"),
    "merger": (
        "model.visual.merger.*",
        "model.visual.merger.mlp.*",
        "model.visual.deepstack_merger_list.*.*",
    ),
}
"""The vision tower and its merger in the Qwen-VL layout (requested by name; not adapted by default)."""

AUDIO_LORA = {
    "audio": (
        "model.audio_tower.layers.*.self_attn.*",
        "model.audio_tower.layers.*.fc1",
        "model.audio_tower.layers.*.fc2",
    ),
}
"""The audio tower of the Qwen omni thinkers (requested by name; not adapted by default)."""


@attrs.frozen(kw_only=True)
class ModelTypeSpec:
    """One HF ``model_type`` (or a diffusers ``_class_name``) of a family.

    Attributes:
        model_type: the ``model_type`` of ``config.json`` (diffusers: its ``_class_name``).
        config: ``"module:Class"`` of the config class (None for a diffusers model: its config is plain JSON).
        classes: ``{task: "module:Class"}`` (tasks: `veomni.models.registry.TASKS`); empty for a config-only alias
            (a full omni checkpoint whose thinker another ``model_type`` builds).
        fast_paths: the `veomni.models.registry.FAST_PATHS` the classes support.
        data: the data pipeline's rules for a multimodal model; None for text-only models.
        library: ``"transformers"`` or ``"diffusers"``.
        diffusion: a diffusion transformer's `DiffusionRules` (diffusers only); None: the ``dit`` task refuses
            the model, and the diffusers build binds no kernels and no Ulysses SP to it. Its ``fast_paths``
            must say what it implements: ``"sp"`` iff ``sequence_parallel``, ``"fused_kernels"`` iff
            ``bind_kernels``.
        lora: where LoRA adapters go (`LoraTargets`); None: a LoRA recipe must name its target modules itself.
        async_ulysses: ``"module:Class"`` of every attention class whose forward has the async Ulysses branch
            (``parallel.async_ulysses``: it asks `veomni.models.hf.async_sp.async_ulysses_active` and overlaps its
            projections with the exchange); empty: the model has no such path.
        no_async_ulysses: why ``parallel.async_ulysses`` is refused for this model. A model with ``"sp"`` in its
            ``fast_paths`` gives exactly one of ``async_ulysses`` and ``no_async_ulysses``; one without gives
            neither (the refusal then says it has no Ulysses SP at all).
    """

    model_type: str
    config: str | None = attrs.field(default=None, validator=_optional_target("ModelTypeSpec"))
    classes: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    fast_paths: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    data: DataRules | None = None
    library: str = "transformers"
    diffusion: DiffusionRules | None = None
    lora: LoraTargets | None = None
    async_ulysses: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    no_async_ulysses: str | None = None

    def __attrs_post_init__(self) -> None:
        for task, target in self.classes.items():
            _target(target, f"model_type {self.model_type!r} / {task}")
        for target in self.async_ulysses:
            _target(target, f"model_type {self.model_type!r} / async_ulysses")
        if self.library not in ("transformers", "diffusers"):
            raise ValueError(
                f"model_type {self.model_type!r}: library must be 'transformers' or 'diffusers', got {self.library!r}"
            )
        if (self.config is None) != (self.library == "diffusers"):
            raise ValueError(
                f"model_type {self.model_type!r}: a transformers model names its config class, a diffusers one none"
            )
        if self.diffusion is not None:
            self._check_diffusion(self.diffusion)
        self._check_async_ulysses()

    def _check_async_ulysses(self) -> None:
        declared = {
            "async_ulysses": bool(self.async_ulysses),
            "no_async_ulysses": self.no_async_ulysses is not None,
        }
        if "sp" in self.fast_paths and sum(declared.values()) != 1:
            raise ValueError(
                f"model_type {self.model_type!r} supports sp: declare either async_ulysses (its attention classes "
                f"with the async branch) or no_async_ulysses (why it has none), found {declared}"
            )
        if "sp" not in self.fast_paths and any(declared.values()):
            raise ValueError(
                f"model_type {self.model_type!r} declares {[k for k, v in declared.items() if v]} but has no 'sp' "
                f"in its fast_paths {sorted(self.fast_paths)}: async Ulysses is a form of Ulysses SP"
            )

    def _check_diffusion(self, rules: DiffusionRules) -> None:
        if self.library != "diffusers":
            raise ValueError(f"model_type {self.model_type!r}: DiffusionRules are for diffusers models only")
        declared = {"sp": rules.sequence_parallel, "fused_kernels": rules.bind_kernels}
        wrong = [p for p, hook in declared.items() if (p in self.fast_paths) != (hook is not None)]
        if wrong:
            raise ValueError(
                f"_class_name {self.model_type!r}: fast_paths {sorted(self.fast_paths)} disagree with its "
                f"DiffusionRules for {wrong} (sp needs sequence_parallel, fused_kernels needs bind_kernels)"
            )


@attrs.frozen(kw_only=True)
class ModelFamily:
    """A model family: its model types and everything the rest of veomni asks about them (module docstring).

    Attributes:
        name: the family folder's name (``veomni.models.<name>``).
        model_types: its `ModelTypeSpec` entries.
        patch_configs: the patch-config modules patchgen generates this family's modeling from.
        hooks: the trainer's hooks (`TrainingHooks`).
    """

    name: str
    model_types: tuple[ModelTypeSpec, ...] = attrs.field(converter=tuple)
    patch_configs: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    hooks: TrainingHooks = TrainingHooks()

    def __attrs_post_init__(self) -> None:
        if not self.model_types:
            raise ValueError(f"family {self.name!r}: declare at least one model type")
        seen = [spec.model_type for spec in self.model_types]
        duplicated = sorted({t for t in seen if seen.count(t) > 1})
        if duplicated:
            raise ValueError(f"family {self.name!r} declares model types {duplicated} twice")

    def spec(self, model_type: str) -> ModelTypeSpec | None:
        """The entry of ``model_type``, or None when this family does not declare it."""
        return next((spec for spec in self.model_types if spec.model_type == model_type), None)


def resolve(target: str) -> Any:
    """Import ``"package.module:attribute"`` (dotted attributes allowed: ``Class.from_config``) and return it."""
    import importlib

    module_name, attribute = _target(target, "resolve").split(":")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import {module_name!r} (family entry {target!r}): {err}") from err
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError as err:
            raise ImportError(f"{target!r}: {module_name} has no attribute {attribute!r}") from err
    return value
