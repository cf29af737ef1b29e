"""Multimodal row encoders (``data.kind: multimodal``), chosen by the model's data rules, never by its name.

A multimodal model's family declares how its rows are laid out (`veomni.models.family.DataRules`): an encoder
kind, named by concept, and ``"module:callable"`` targets for its position rule, video rule and audio rules. This
module maps encoder kinds to builders (`ENCODER_KINDS`; `register_encoder_kind` adds one) and builds the encoder
of a run from the rules and the model config (`multimodal_encoder`):

==========================  ==============================================================  =====================
kind                        rows                                                            encoder
==========================  ==============================================================  =====================
``vision``                  images, videos with one timestamped run per temporal patch       `MultimodalEncoder`
``vision_untimed_video``    images, videos as one placeholder run each                      `UntimedVideoEncoder`
``audio_visual``            images, videos (optionally with their audio tracks), audio      `AudioVisualEncoder`
==========================  ==============================================================  =====================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from veomni.models.family import DataRules, resolve
from veomni.train.data.sources import DataError

if TYPE_CHECKING:
    from veomni.train.recipe import DataSection

EncoderBuilder = Callable[..., Any]
"""``builder(data, tokenizer, rules, config, vision_metadata) -> encoder``: ``data`` the recipe's data section,
``rules`` the model's `DataRules`, ``config`` the model config, ``vision_metadata`` the model's host-side vision
layout (or None)."""

ENCODER_KINDS: dict[str, str] = {
    "vision": "veomni.train.data.encoders:vision_encoder",
    "vision_untimed_video": "veomni.train.data.encoders:untimed_video_encoder",
    "audio_visual": "veomni.train.data.encoders:audio_visual_encoder",
}
"""Built-in encoder kinds -> their builder (imported on first use: a text run imports none of them)."""

_REGISTERED: dict[str, EncoderBuilder] = {}

F = TypeVar("F", bound=EncoderBuilder)


def register_encoder_kind(name: str) -> Callable[[F], F]:
    """Decorator: make ``builder`` (`EncoderBuilder`) the encoder of ``DataRules(encoder=name)``; a taken name is an
    error."""

    def register(builder: F) -> F:
        if name in ENCODER_KINDS or name in _REGISTERED:
            raise ValueError(f"encoder kind {name!r} is already registered")
        _REGISTERED[name] = builder
        return builder

    return register


def encoder_kinds() -> list[str]:
    """Every encoder kind (built in and registered), sorted."""
    return sorted({*ENCODER_KINDS, *_REGISTERED})


def encoder_builder(kind: str) -> EncoderBuilder:
    """The builder of encoder kind ``kind`` (an error names the kinds there are)."""
    if kind in _REGISTERED:
        return _REGISTERED[kind]
    if kind not in ENCODER_KINDS:
        raise DataError(f"data rules name the encoder kind {kind!r}; the encoder kinds are {encoder_kinds()}")
    return resolve(ENCODER_KINDS[kind])  # type: ignore[no-any-return]


def families_with_data_rules() -> list[str]:
    """``"family (model_type, ...)"`` for every built-in family that declares data rules."""
    from veomni.models.families import FAMILIES

    found = []
    for family in FAMILIES:
        types = [spec.model_type for spec in family.model_types if spec.data is not None]
        if types:
            found.append(f"{family.name} ({', '.join(types)})")
    return found


def multimodal_encoder(
    data: DataSection,
    tokenizer: Any,
    *,
    vision_metadata: Callable[..., Any] | None = None,
    data_rules: DataRules | None = None,
    model_config: Any = None,
) -> Any:
    """The encoder of ``data.kind: multimodal`` for the model ``model_config`` describes, laid out by its family's
    ``data_rules`` (`veomni.models.families.data_rules`). A model without data rules is a `DataError` naming its
    ``model_type`` and the families that declare some."""
    model_type = getattr(model_config, "model_type", None)
    if data_rules is None or model_config is None:
        raise DataError(
            f"data.kind is multimodal but model_type {model_type!r} has no data rules: no veomni family declares how "
            f"its image, video or audio rows are laid out. Families that declare data rules: "
            f"{'; '.join(families_with_data_rules())}"
        )
    return encoder_builder(data_rules.encoder)(data, tokenizer, data_rules, model_config, vision_metadata)


def load_video_rule(rules: DataRules, path: str, config: Any, data: DataSection) -> Any:
    """The model's video rule from the processor files at ``path`` (``rules.video_rule``, with ``data.video_fps``
    / ``video_max_frames`` / ``video_frame_pixels``), or why there is none as a string: data without videos does
    not need one, and a video row reports it."""
    if rules.video_rule is None:
        return rules.no_video or f"{config.model_type} declares no video rule"
    try:
        return resolve(rules.video_rule)(
            path,
            config,
            fps=data.video_fps,
            max_frames=data.video_max_frames,
            frame_pixels=data.video_frame_pixels,
        )
    except (OSError, ValueError) as err:
        return f"{path} holds no usable video processor config for {config.model_type} ({err})"


def _common(
    data: DataSection, tokenizer: Any, vision_metadata: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments every multimodal encoder takes: tokenizer, image processor, fields; media root, patch budget,
    vision layout."""
    from veomni.train.data.multimodal import load_image_processor

    args = (
        tokenizer, load_image_processor(tokenizer.name_or_path), data.messages_field, data.loss_mask_field,
        data.assistant_only_loss,
    )  # fmt: skip
    return args, {
        "media_root": data.media_root,
        "max_patches": data.patches_per_micro_batch,
        "vision_metadata": vision_metadata,
    }


def check_vision_tokens(encoder: Any, config: Any) -> None:
    """The tokenizer's image / video placeholders are the model config's ``image_token_id`` / ``video_token_id``
    and the image processor's merge size is the tower's ``spatial_merge_size`` (a `DataError` otherwise): the
    model finds its placeholders by these ids."""
    for name, token_id in (
        ("image_token_id", encoder.image_token_id),
        ("video_token_id", encoder.video_token_id),
    ):
        expected = getattr(config, name, None)
        if expected is not None and token_id is not None and int(expected) != int(token_id):
            raise DataError(
                f"the model config's {name} is {expected} but the tokenizer's placeholder is {token_id}; they must be "
                "the same token"
            )
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if merge is not None and int(merge) != encoder.merge:
        raise DataError(
            f"the model's spatial_merge_size is {merge} but the image processor's merge_size is {encoder.merge}"
        )


def _refuse_audio_options(data: DataSection, rules: DataRules, config: Any) -> None:
    for key in ("use_audio_in_video", "video_frame_pixels"):
        if getattr(data, key) not in (None, False):
            raise DataError(
                f"data.{key} is set, but only an audio-visual model (an omni thinker, model.task=omni) reads it; "
                f"{config.model_type}'s rows are laid out by the {rules.encoder!r} encoder"
            )


def _vision(
    cls: type, data: DataSection, tokenizer: Any, rules: DataRules, config: Any, metadata: Any
) -> Any:
    _refuse_audio_options(data, rules, config)
    args, kwargs = _common(data, tokenizer, metadata)
    assert rules.positions is not None  # DataRules requires it
    encoder = cls(
        *args, positions=resolve(rules.positions)(config),
        video_rule=load_video_rule(rules, tokenizer.name_or_path, config, data), **kwargs,
    )  # fmt: skip
    check_vision_tokens(encoder, config)
    return encoder


def vision_encoder(data: DataSection, tokenizer: Any, rules: DataRules, config: Any, metadata: Any) -> Any:
    """Encoder kind ``vision``: `veomni.train.data.multimodal.MultimodalEncoder`."""
    from veomni.train.data.multimodal import MultimodalEncoder

    return _vision(MultimodalEncoder, data, tokenizer, rules, config, metadata)


def untimed_video_encoder(
    data: DataSection, tokenizer: Any, rules: DataRules, config: Any, metadata: Any
) -> Any:
    """Encoder kind ``vision_untimed_video``: `veomni.train.data.untimed_video.UntimedVideoEncoder`."""
    from veomni.train.data.untimed_video import UntimedVideoEncoder

    return _vision(UntimedVideoEncoder, data, tokenizer, rules, config, metadata)


def audio_visual_encoder(
    data: DataSection, tokenizer: Any, rules: DataRules, config: Any, metadata: Any
) -> Any:
    """Encoder kind ``audio_visual``: `veomni.train.data.audio_visual.AudioVisualEncoder` (needs the rules'
    ``audio_tokens``)."""
    from veomni.train.data.audio_visual import AudioVisualEncoder, load_feature_extractor

    if rules.audio_tokens is None:
        raise DataError(
            f"{config.model_type}'s data rules use the audio_visual encoder but name no audio_tokens rule (how many "
            "tokens one audio clip becomes)"
        )
    assert rules.positions is not None  # DataRules requires it
    args, kwargs = _common(data, tokenizer, metadata)
    return AudioVisualEncoder(
        *args,
        feature_extractor=load_feature_extractor(tokenizer.name_or_path),
        config=config,
        positions=resolve(rules.positions)(config, use_audio_in_video=data.use_audio_in_video),
        audio_tokens=resolve(rules.audio_tokens),
        audio_layout=None if rules.audio_layout is None else resolve(rules.audio_layout)(config),
        video_rule=load_video_rule(rules, tokenizer.name_or_path, config, data),
        use_audio_in_video=data.use_audio_in_video,
        **kwargs,
    )


__all__ = [
    "ENCODER_KINDS",
    "EncoderBuilder",
    "encoder_builder",
    "encoder_kinds",
    "load_video_rule",
    "multimodal_encoder",
    "register_encoder_kind",
]
