"""Model-config keys are checked against what the config class reads, because transformers does not check them.

A ``PreTrainedConfig`` (a dataclass in transformers 5.23) hands every keyword it has no field for to
``__post_init__``, which stores it as a plain attribute; ``from_pretrained(path, **kwargs)`` drops a keyword the
config has no attribute for. Either way a typo (``num_hiden_layers``) trains the default model without a word.

What a class accepts (`accepted_config_keys`):

- ``stage="init"`` (a mapping the config is constructed from, e.g. a recipe's inline ``model.config``): its
  dataclass fields, its ``__init__`` parameters (classes with a hand-written ``__init__``), its
  ``attribute_map`` aliases, its settable properties, the attributes of a default instance, the optional keys
  its modeling file (and ``transformers.modeling_utils``) reads with ``getattr(config, "name", default)`` /
  ``hasattr`` or directly as ``self.config.name`` (Qwen3-MoE's ``head_dim``, the Qwen2.5-Omni thinker's
  ``vision_start_token_id``; the file is read as text, not imported), the keywords
  ``PreTrainedConfig.__post_init__`` consumes (``torch_dtype``, ``num_labels``, ``attn_implementation``, ...) and,
  for classes with ``rope_parameters``, the legacy RoPE keywords it folds into them (``rope_theta``, ...);
- ``stage="override"`` (attributes set on a built config, as ``build_model(config_overrides=...)`` does): the
  same minus the construction-only keywords, which an attribute set after construction would not reach.

Composite configs (``sub_configs``, e.g. a VLM's ``text_config`` / ``vision_config``): a sub-config key takes a
mapping whose keys are checked against the sub-config's class (recursively), or a config object; a dotted key
(``text_config.num_hidden_layers``) addresses one sub-config key. A flat key that only a sub-config has is an
error that names the dotted form: transformers would store it on the outer config, where no model code reads it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Literal

from transformers import PretrainedConfig
from transformers.generation import GenerationConfig

# Keywords PreTrainedConfig.__post_init__ consumes without keeping an attribute of that name.
_INIT_ONLY = frozenset(
    {
        "torch_dtype",
        "num_labels",
        "name_or_path",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "per_layer_config",
    }
)
# Folded into ``rope_parameters`` at construction by ``convert_rope_params_to_dict``.
_ROPE_LEGACY = frozenset({"rope_theta", "rope_scaling", "partial_rotary_factor"})

Stage = Literal["init", "override"]


@functools.cache
def _default_instance(cls: type[PretrainedConfig]) -> PretrainedConfig | None:
    try:
        return cls()
    except Exception:  # a class with required arguments: its fields and signature still count
        return None


def _quiet_hasattr(obj: object, name: str) -> bool:
    # Deprecated aliases (torch_dtype) log a deprecation warning when read; probing them is not a use.
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return hasattr(obj, name)
    finally:
        logger.setLevel(level)


# ``getattr(config, "head_dim", ...)`` / ``hasattr(self.config, "x")``: optional keys that modeling code reads
# without the config class declaring them (Qwen3-MoE's head_dim).
_READ_PATTERN = re.compile(r"""\b(?:getattr|hasattr)\(\s*(?:self\.)?\w*config\s*,\s*["'](\w+)["']""")
# ``self.config.vision_start_token_id``: a key read directly that the config class does not declare (the
# Qwen2.5-Omni thinker's vision start token: checkpoints carry it, the thinker's rope index needs it).
_DIRECT_READ = re.compile(r"""\bself\.config\.(\w+)\b(?!\s*\()""")


@functools.cache
def _optional_reads(module_name: str) -> frozenset[str]:
    spec = importlib.util.find_spec(module_name) if module_name else None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return frozenset()
    with open(spec.origin, encoding="utf-8") as handle:
        text = handle.read()
    return frozenset(_READ_PATTERN.findall(text)) | frozenset(_DIRECT_READ.findall(text))


def _modeling_reads(cls: type[PretrainedConfig]) -> frozenset[str]:
    # The modeling file beside the configuration file (read as text, not imported) and the generic model code.
    package, _, module = cls.__module__.rpartition(".")
    modeling = f"{package}.{module.replace('configuration_', 'modeling_', 1)}" if package else ""
    return _optional_reads(modeling) | _optional_reads("transformers.modeling_utils")


@functools.cache
def accepted_config_keys(cls: type[PretrainedConfig], stage: Stage = "init") -> frozenset[str]:
    """The top-level keys ``cls`` reads (see the module docstring); sub-config keys are not included."""
    if stage not in ("init", "override"):
        raise ValueError(f"stage must be 'init' or 'override', got {stage!r}")
    default = _default_instance(cls)
    keys: set[str] = set(vars(default)) if default is not None else set()
    if dataclasses.is_dataclass(cls):
        keys |= {f.name for f in dataclasses.fields(cls)}
    keys |= set(getattr(cls, "attribute_map", {}) or {})
    keys |= _modeling_reads(cls)
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            # A setter whose getter fails on this class (rope_scaling without rope_parameters) writes a dead
            # attribute.
            settable = isinstance(value, property) and value.fset is not None
            if settable and (default is None or _quiet_hasattr(default, name)):
                keys.add(name)
    if stage == "init":
        params = inspect.signature(cls.__init__).parameters.values()
        keys |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
        keys |= _INIT_ONLY
        if "rope_parameters" in keys:
            keys |= _ROPE_LEGACY
    keys.discard("model_type")
    return frozenset(keys)


def _sub_config_class(cls: type[PretrainedConfig], key: str, value: object) -> type[PretrainedConfig] | None:
    spec = (getattr(cls, "sub_configs_defaults", None) or {}).get(key)
    if spec is None:
        return None
    if isinstance(spec.config_class, type) and issubclass(spec.config_class, PretrainedConfig):
        return spec.config_class
    # AutoConfig sub-configs: the mapping's own model_type, else the spec's default.
    model_type = value.get("model_type") if isinstance(value, Mapping) else None
    return spec.get_config_class(model_type or spec.model_type)


def _problems(
    cls: type[PretrainedConfig], keys: Mapping[str, object], prefix: str, stage: Stage
) -> list[str]:
    accepted = accepted_config_keys(cls, stage)
    sub_keys = list(getattr(cls, "sub_configs", {}) or {})
    generation = set(GenerationConfig._get_default_generation_params())
    problems = []
    for key, value in keys.items():
        head, _, rest = key.partition(".")
        if head in sub_keys:
            sub_cls = _sub_config_class(cls, head, value)
            if rest:
                problems += _problems(sub_cls, {rest: value}, f"{prefix}{head}.", stage)
            elif isinstance(value, Mapping):
                nested = {k: v for k, v in value.items() if k != "model_type"}
                problems += _problems(sub_cls, nested, f"{prefix}{head}.", stage)
            elif not (value is None or isinstance(value, PretrainedConfig)):
                problems.append(
                    f"{prefix}{head}: expected a mapping of {sub_cls.__name__} keys or a config, "
                    f"found {type(value).__name__}"
                )
            continue
        if rest or key not in accepted:
            problems.append(_explain(cls, prefix, key, accepted, sub_keys, generation, stage))
    return problems


def _explain(
    cls: type[PretrainedConfig], prefix: str, key: str, accepted: frozenset[str], sub_keys: list[str],
    generation: set[str], stage: Stage,
) -> str:  # fmt: skip
    head = key.partition(".")[0]
    text = f"{prefix + key!r} is not a key of {cls.__name__}"
    if key == "model_type":
        return f"{text}: model_type selects the config class and cannot be set here"
    if "." in key:
        return f"{text}: {head!r} is not one of its sub-configs {sub_keys}"
    owners = [s for s in sub_keys if key in _sub_accepts(cls, s, stage)]
    if owners:
        dotted = " or ".join(f"{prefix}{owner}.{key}" for owner in owners)
        return (
            f"{text} but of its sub-config(s) {owners}: write {dotted} (transformers would store it on the outer "
            "config, where the model never reads it)"
        )
    if stage == "override" and key in accepted_config_keys(cls, "init"):
        return (
            f"{text} after construction: it is read only when the config is built (set rope_parameters etc.)"
        )
    if key in generation:
        return f"{text}: it is a generation setting (generation_config.json), which the model config drops"
    close = difflib.get_close_matches(key, sorted(accepted), n=3, cutoff=0.75)
    return text + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "")


def _sub_accepts(cls: type[PretrainedConfig], key: str, stage: Stage) -> frozenset[str]:
    sub_cls = _sub_config_class(cls, key, None)
    return accepted_config_keys(sub_cls, stage) if sub_cls is not None else frozenset()


def check_config_keys(
    config: type[PretrainedConfig] | PretrainedConfig,
    keys: Mapping[str, object] | Iterable[str],
    where: str,
    *,
    stage: Stage = "init",
) -> None:
    """Raise unless every key is one ``config``'s class reads (see the module docstring).

    Args:
        config: a config class or instance (`veomni.models.registry.check_config_keys` also takes a model_type).
        keys: a mapping (nested mappings under sub-config keys are checked too) or plain key names; dotted
            names address sub-configs.
        where: names the source in the error (``"model.config"``, ``"build_model(config_overrides=...)"``).
        stage: ``"init"`` for keys the config is constructed from, ``"override"`` for attributes set afterwards.
    Raises:
        ValueError: listing every unknown key, with the closest accepted keys (difflib).
    """
    cls = config if isinstance(config, type) else type(config)
    if not (isinstance(cls, type) and issubclass(cls, PretrainedConfig)):
        raise TypeError(f"check_config_keys: expected a PretrainedConfig class or instance, got {config!r}")
    mapping = keys if isinstance(keys, Mapping) else dict.fromkeys(keys)
    for key in mapping:
        if not isinstance(key, str):
            raise TypeError(f"{where}: config keys must be strings, found {key!r}")
    problems = _problems(cls, mapping, "", stage)
    if problems:
        model_type = getattr(cls, "model_type", "") or "?"
        raise ValueError(
            f"{where}: {len(problems)} unknown key(s) for {cls.__name__} (model_type {model_type!r}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


# Both set the RoPE parameters on a built config (``rope_scaling`` is transformers' deprecated alias).
_ROPE_OVERRIDES = frozenset({"rope_parameters", "rope_scaling"})


def _apply_rope_override(config: PretrainedConfig, key: str, value: object) -> None:
    """Set ``config.rope_parameters`` from an override as transformers does when it builds a config: a value
    that names no ``rope_theta`` keeps the config's, then the parameters are standardised and validated.

    transformers' attribute setter replaces the whole dict instead, so ``{"rope_type": "yarn", "factor": 4}``
    (the usual context-extension override) would leave ``rope_theta`` None and fail deep in the rotary init.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"config overrides: {key} must be a mapping of RoPE parameters, found {value!r}")
    value = copy.deepcopy(dict(value))
    current = getattr(config, "rope_parameters", None) or {}
    nested = config.nested_rope_parameter_keys(value)
    # Flat parameters take the flat theta; per-layer-type ones (Gemma-style) each take their own layer type's.
    pairs = [(value[k], current.get(k)) for k in nested] if nested else [(value, current)]
    for params, before in pairs:
        if isinstance(params, dict) and isinstance(before, Mapping) and "rope_theta" in before:
            params.setdefault("rope_theta", before["rope_theta"])
    config.rope_parameters = value
    try:
        config.standardize_rope_params()
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(
            f"config overrides: {key} {value!r} is not valid for {type(config).__name__}: {err}"
        ) from None


def apply_config_overrides(config: PretrainedConfig, overrides: Mapping[str, object]) -> None:
    """Set checked ``overrides`` on ``config`` in place, as attributes (what ``from_pretrained(**kwargs)`` does
    with keys the config has); a mapping or a dotted key under a sub-config key sets that sub-config's attributes.

    Values are copied (the caller's mapping is never changed). ``rope_parameters`` / ``rope_scaling`` keep the
    config's ``rope_theta`` unless they name one and are validated (`_apply_rope_override`). Other derived fields
    are not recomputed (e.g. ``layer_types`` after ``num_hidden_layers``), as in transformers.
    """
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        target = getattr(config, head, None)
        if rest and isinstance(target, PretrainedConfig):
            apply_config_overrides(target, {rest: value})
        elif isinstance(value, Mapping) and isinstance(target, PretrainedConfig):
            apply_config_overrides(target, {k: v for k, v in value.items() if k != "model_type"})
        elif key in _ROPE_OVERRIDES and value is not None and hasattr(config, "standardize_rope_params"):
            _apply_rope_override(config, key, value)
        else:
            setattr(config, key, copy.deepcopy(value))
