"""Model registries keyed by HF ``model_type``: config classes, modeling classes per task, processors.

Entries are ``"module:attr"`` strings resolved on first use, so registering imports nothing and a broken
adapter only fails the model that uses it. Registering a name twice is an error. A ``model_type`` that is not
registered falls back to transformers' Auto classes, with a warning that names the fast paths (Ulysses SP,
expert parallelism, fused kernels) that model runs without; a registered one never falls back.

`MODELS` is the registry `build_model` uses by default; its built-in entries are at the bottom of this file.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
from transformers import AutoConfig, PretrainedConfig

from veomni.models import config_keys
from veomni.models.config_keys import apply_config_overrides

logger = logging.getLogger(__name__)

# task -> the name of transformers' Auto mapping for it (in transformers.models.auto.modeling_auto).
TASKS: Mapping[str, str] = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "base": "MODEL_MAPPING",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
    "question_answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING",
    "image_text_to_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
}
FAST_PATHS: Mapping[str, str] = {
    "sp": "Ulysses sequence parallelism",
    "ep": "expert parallelism",
    "fused_kernels": "fused kernels (RMSNorm / SwiGLU / RoPE / MoE through OpsConfig)",
}


def _check_target(target: object, what: str) -> str:
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"{what}: expected a 'package.module:Attribute' string, got {target!r}")
    return target


def resolve_target(target: str) -> object:
    """Import ``"package.module:Attribute"`` and return the attribute."""
    module_name, attr = _check_target(target, "resolve_target").split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import {module_name!r} (registry entry {target!r}): {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise ImportError(
            f"module {module_name!r} has no attribute {attr!r} (registry entry {target!r})"
        ) from err


@attrs.frozen
class ModelEntry:
    """A registered model type.

    Attributes:
        model_type: the HF ``model_type``.
        classes: ``{task: "module:Class"}``; tasks are the keys of `TASKS`.
        fast_paths: the `FAST_PATHS` this model's classes support.
    """

    model_type: str
    classes: Mapping[str, str]
    fast_paths: frozenset[str]


@attrs.frozen
class ResolvedModel:
    """The class `ModelRegistry.model_class` chose.

    Attributes:
        cls: the modeling class.
        registered: False when it is transformers' own class (Auto fallback).
        fast_paths: the fast paths available for it.
    """

    cls: type
    registered: bool
    fast_paths: frozenset[str]


class ModelRegistry:
    """Config, modeling and processor registries; see the module docstring."""

    def __init__(self) -> None:
        self._configs: dict[str, str] = {}
        self._models: dict[str, ModelEntry] = {}
        self._processors: dict[str, str] = {}

    # Registration --------------------------------------------------------------------------------------
    def register_config(self, model_type: str, target: str) -> None:
        """Register the config class (``"module:Class"``) of ``model_type``; twice is an error."""
        if model_type in self._configs:
            raise ValueError(
                f"config for model_type {model_type!r} is already registered ({self._configs[model_type]})"
            )
        self._configs[model_type] = _check_target(target, f"config of {model_type!r}")

    def register_model(
        self, model_type: str, classes: Mapping[str, str], *, fast_paths: frozenset[str] | set[str]
    ) -> None:
        """Register the modeling classes of ``model_type`` (``{task: "module:Class"}``); twice is an error."""
        if model_type in self._models:
            raise ValueError(
                f"model_type {model_type!r} is already registered ({dict(self._models[model_type].classes)})"
            )
        if not classes:
            raise ValueError(f"model_type {model_type!r}: register at least one task class")
        for task, target in classes.items():
            if task not in TASKS:
                raise ValueError(
                    f"model_type {model_type!r}: unknown task {task!r}; tasks are {sorted(TASKS)}"
                )
            _check_target(target, f"{model_type!r} / {task}")
        unknown = set(fast_paths) - set(FAST_PATHS)
        if unknown:
            raise ValueError(
                f"model_type {model_type!r}: unknown fast paths {sorted(unknown)}; known {sorted(FAST_PATHS)}"
            )
        self._models[model_type] = ModelEntry(model_type, dict(classes), frozenset(fast_paths))

    def register_processor(self, class_name: str, target: str) -> None:
        """Register a processor class by its class name (as in ``processor_config.json``); twice is an error."""
        if class_name in self._processors:
            raise ValueError(
                f"processor {class_name!r} is already registered ({self._processors[class_name]})"
            )
        self._processors[class_name] = _check_target(target, f"processor {class_name!r}")

    # Lookup ---------------------------------------------------------------------------------------------
    def model_types(self) -> list[str]:
        """Registered model types, sorted."""
        return sorted(self._models)

    def entry(self, model_type: str) -> ModelEntry | None:
        """The registration of ``model_type``, or None."""
        return self._models.get(model_type)

    def config_class(self, model_type: str) -> type[PretrainedConfig] | None:
        """The registered config class of ``model_type`` (imported now), or None if unregistered."""
        target = self._configs.get(model_type)
        return None if target is None else resolve_target(target)  # type: ignore[return-value]

    def load_config(
        self, config_or_path: PretrainedConfig | str | os.PathLike, **overrides: object
    ) -> PretrainedConfig:
        """A config from an object (copied) or a directory / ``config.json``, with ``overrides`` applied.

        The class is the registered one for its ``model_type``, else transformers' ``AutoConfig``. Override keys
        are checked first (`check_config_keys`, stage ``"override"``): an unknown key is an error with the
        closest accepted keys, never an attribute nothing reads. A mapping or a dotted key under a sub-config
        key (``text_config.num_hidden_layers``) sets that sub-config's attributes.
        """
        if isinstance(config_or_path, PretrainedConfig):
            config = copy.deepcopy(config_or_path)
        else:
            path = Path(config_or_path)
            file = path / "config.json" if path.is_dir() else path
            if not file.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            raw = json.loads(file.read_text())
            model_type = raw.get("model_type")
            if not model_type:
                raise ValueError(f"{file} has no 'model_type'; cannot tell which model it configures")
            cls = self.config_class(model_type)
            loader = AutoConfig if cls is None else cls
            config = loader.from_pretrained(str(file.parent))
        if overrides:
            check_config_keys(config, overrides, "config overrides", stage="override")
            apply_config_overrides(config, overrides)
        return config

    def model_class(self, config: PretrainedConfig, task: str = "causal_lm") -> ResolvedModel:
        """The modeling class for ``config.model_type`` and ``task``.

        A registered model type uses its registered class (no fallback: a missing task or a broken import is
        an error). An unregistered one uses transformers' Auto mapping for ``task`` and logs a warning naming
        the fast paths that are off for it.
        """
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; tasks are {sorted(TASKS)}")
        model_type = config.model_type
        entry = self._models.get(model_type)
        if entry is not None:
            if task not in entry.classes:
                raise ValueError(
                    f"model_type {model_type!r} is registered with veomni for tasks {sorted(entry.classes)}, "
                    f"not {task!r}"
                )
            return ResolvedModel(resolve_target(entry.classes[task]), True, entry.fast_paths)  # type: ignore[arg-type]
        from transformers.models.auto import modeling_auto

        mapping = getattr(modeling_auto, TASKS[task])
        try:
            cls = mapping[type(config)]
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"model_type {model_type!r} is not registered with veomni (registered: {self.model_types()}) and "
                f"transformers has no {TASKS[task]} class for {type(config).__name__}"
            ) from err
        fast = {"sp"} if getattr(cls, "_supports_attention_backend", False) else set()
        off = [FAST_PATHS[p] for p in FAST_PATHS if p not in fast]
        logger.warning(
            "model_type %r is not registered with veomni: using transformers' %s (from %s). Off for this "
            "model: %s.%s",
            model_type,
            cls.__name__,
            TASKS[task],
            "; ".join(off),
            " Ulysses SP still works through HF's attention interface." if fast else "",
        )
        return ResolvedModel(cls, False, frozenset(fast))

    def processor_class(self, class_name: str) -> type:
        """The registered processor class ``class_name``, else transformers' class of that name."""
        target = self._processors.get(class_name)
        if target is not None:
            return resolve_target(target)  # type: ignore[return-value]
        import transformers

        cls = getattr(transformers, class_name, None)
        if not isinstance(cls, type):
            raise ValueError(
                f"processor {class_name!r} is neither registered with veomni ({sorted(self._processors)}) nor a "
                "transformers class"
            )
        logger.info(
            "processor %r is not registered with veomni: using transformers.%s", class_name, class_name
        )
        return cls


def check_config_keys(
    config: str | type[PretrainedConfig] | PretrainedConfig,
    keys: Mapping[str, object] | Iterable[str],
    where: str,
    *,
    stage: config_keys.Stage = "init",
    registry: ModelRegistry | None = None,
) -> None:
    """Raise a ValueError naming every key that ``config``'s class does not read, with did-you-mean suggestions.

    Args:
        config: a ``model_type`` (its registered config class, else transformers' ``CONFIG_MAPPING``), a config
            class, or a config.
        keys: a mapping (nested mappings under sub-config keys such as ``text_config`` are checked against the
            sub-config class) or key names (dotted names address sub-configs).
        where: the source, for the message (``"model.config"``).
        stage: ``"init"`` for a mapping the config will be constructed from (``AutoConfig.for_model(type,
            **mapping)``), ``"override"`` for attributes set on a built config (`ModelRegistry.load_config`).
        registry: where ``model_type`` is looked up (default `MODELS`).
    """
    if isinstance(config, str):
        registry = MODELS if registry is None else registry
        cls = registry.config_class(config)
        if cls is None:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if config not in CONFIG_MAPPING:
                raise ValueError(
                    f"{where}: unknown model_type {config!r}: neither registered with veomni "
                    f"({registry.model_types()}) nor known to transformers"
                )
            cls = CONFIG_MAPPING[config]
        config = cls
    config_keys.check_config_keys(config, keys, where, stage=stage)


def _register_builtin(registry: ModelRegistry) -> None:
    families = (
        (
            "llama",
            "Llama",
            "transformers.models.llama.configuration_llama:LlamaConfig",
            {"sp", "fused_kernels"},
        ),
        (
            "qwen2",
            "Qwen2",
            "transformers.models.qwen2.configuration_qwen2:Qwen2Config",
            {"sp", "fused_kernels"},
        ),
        (
            "qwen3",
            "Qwen3",
            "transformers.models.qwen3.configuration_qwen3:Qwen3Config",
            {"sp", "fused_kernels"},
        ),
        (
            "qwen3_moe",
            "Qwen3Moe",
            "transformers.models.qwen3_moe.configuration_qwen3_moe:Qwen3MoeConfig",
            {"sp", "ep", "fused_kernels"},
        ),
    )
    for model_type, prefix, config, fast_paths in families:
        module = f"veomni.models.{model_type}.generated.patched_modeling_{model_type}"
        registry.register_config(model_type, config)
        registry.register_model(
            model_type,
            {
                "causal_lm": f"{module}:{prefix}ForCausalLM",
                "base": f"{module}:{prefix}Model",
                "sequence_classification": f"{module}:{prefix}ForSequenceClassification",
                "token_classification": f"{module}:{prefix}ForTokenClassification",
                "question_answering": f"{module}:{prefix}ForQuestionAnswering",
            },
            fast_paths=fast_paths,
        )


MODELS = ModelRegistry()
"""The default registry, filled with veomni's adapters at import."""
_register_builtin(MODELS)
