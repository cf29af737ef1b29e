"""Model registries keyed by HF ``model_type`` (diffusers: ``_class_name``): config classes, modeling classes
per task, processors.

Entries are ``"module:attr"`` strings resolved on first use, so registering imports nothing and a broken
adapter only fails the model that uses it. Registering a name twice is an error. A ``model_type`` that is not
registered falls back to transformers' Auto classes, with a warning that names the fast paths (Ulysses SP,
expert parallelism, fused kernels) that model runs without; a registered one never falls back, except when the
caller asks for ``backend="hf"`` (transformers' own class, unpatched).

Tasks (`TASKS`) name what a recipe trains: ``causal_lm``, ``image_text_to_text`` (VLMs), ``any_to_any`` (omni
thinkers: text + image/audio/video in, text out), ``diffusion_transformer`` (diffusers DiTs), and the HF heads
(``base``, ``sequence_classification``, ...). A model asked for a task it lacks is an error naming its tasks.

Diffusers models have no ``model_type``: their ``config.json`` names the class in ``_class_name``.
`ModelRegistry.register_diffusers` keys an entry by that name; `ModelRegistry.load_config` returns a
`DiffusersConfig` for such a file (plain JSON, no diffusers import) and `ModelRegistry.model_class` resolves it,
with an error naming the missing package when diffusers is not installed.

`MODELS` is the registry `build_model` uses by default, built from the families (`veomni.models.families`).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
from transformers import AutoConfig, PretrainedConfig

from veomni.models import config_keys
from veomni.models.config_keys import apply_config_overrides
from veomni.models.family import ModelFamily

logger = logging.getLogger(__name__)

# task -> the name of transformers' Auto mapping for it (in transformers.models.auto.modeling_auto); None: a
# diffusers task, resolved through diffusers' own classes.
TASKS: Mapping[str, str | None] = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "base": "MODEL_MAPPING",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
    "question_answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING",
    "image_text_to_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
    # Text plus any of image/audio/video in, text out: the omni thinkers (qwen2_5_omni_thinker, ...) and the
    # full omni models, which transformers lists in its multimodal-LM mapping.
    "any_to_any": "MODEL_FOR_MULTIMODAL_LM_MAPPING",
    "diffusion_transformer": None,
}
DIFFUSERS_TASK = "diffusion_transformer"
BACKENDS = ("veomni", "hf")
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
        model_type: the HF ``model_type``, or a diffusers ``_class_name``.
        classes: ``{task: "module:Class"}``; tasks are the keys of `TASKS`.
        fast_paths: the `FAST_PATHS` this model's classes support.
        library: ``"transformers"`` or ``"diffusers"`` (keyed by ``_class_name``).
    """

    model_type: str
    classes: Mapping[str, str]
    fast_paths: frozenset[str]
    library: str = "transformers"


@attrs.frozen
class DiffusersConfig:
    """A diffusers ``config.json`` (no ``model_type``; ``_class_name`` names the model class).

    Attributes:
        class_name: the ``_class_name``.
        values: the whole JSON mapping, as ``ModelMixin.from_config`` takes it.
        source: the file it was read from.
    """

    class_name: str
    values: Mapping[str, object]
    source: str

    @property
    def model_type(self) -> str:
        """The registry key (the ``_class_name``), so error messages and lookups treat both kinds alike."""
        return self.class_name


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
            if task == DIFFUSERS_TASK:
                raise ValueError(
                    f"model_type {model_type!r}: {DIFFUSERS_TASK!r} models are diffusers classes keyed by "
                    "_class_name; register them with register_diffusers"
                )
            _check_target(target, f"{model_type!r} / {task}")
        self._models[model_type] = ModelEntry(model_type, dict(classes), _fast_paths(model_type, fast_paths))

    def register_diffusers(
        self, class_name: str, target: str, *, fast_paths: frozenset[str] | set[str]
    ) -> None:
        """Register the veomni class (``"module:Class"``, imported on first use) for a diffusers model whose
        ``config.json`` has ``"_class_name": class_name``; its task is ``diffusion_transformer``. Twice is an
        error, as is a name already registered as a model_type."""
        if class_name in self._models:
            raise ValueError(
                f"_class_name {class_name!r} is already registered ({dict(self._models[class_name].classes)})"
            )
        classes = {DIFFUSERS_TASK: _check_target(target, f"diffusers {class_name!r}")}
        self._models[class_name] = ModelEntry(
            class_name, classes, _fast_paths(class_name, fast_paths), "diffusers"
        )

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
        self, config_or_path: PretrainedConfig | DiffusersConfig | str | os.PathLike, **overrides: object
    ) -> PretrainedConfig | DiffusersConfig:
        """A config from an object (copied) or a directory / ``config.json``, with ``overrides`` applied.

        The class is the registered one for its ``model_type``, else transformers' ``AutoConfig``. Override keys
        are checked first (`check_config_keys`, stage ``"override"``): an unknown key is an error with the
        closest accepted keys, never an attribute nothing reads. A mapping or a dotted key under a sub-config
        key (``text_config.num_hidden_layers``) sets that sub-config's attributes.

        A file without ``model_type`` but with diffusers' ``_class_name`` gives a `DiffusersConfig` (read as JSON:
        diffusers is not needed until the class is resolved); its overrides must be keys the file already has.
        """
        if isinstance(config_or_path, DiffusersConfig):
            return _diffusers_overrides(config_or_path, overrides)
        if isinstance(config_or_path, PretrainedConfig):
            config = copy.deepcopy(config_or_path)
        else:
            path = Path(config_or_path)
            file = path / "config.json" if path.is_dir() else path
            if not file.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            raw = json.loads(file.read_text())
            model_type = raw.get("model_type")
            if not model_type and isinstance(raw.get("_class_name"), str):
                return _diffusers_overrides(DiffusersConfig(raw["_class_name"], raw, str(file)), overrides)
            if not model_type:
                raise ValueError(
                    f"{file} has neither 'model_type' (transformers) nor '_class_name' (diffusers); cannot tell "
                    "which model it configures"
                )
            cls = self.config_class(model_type)
            loader = AutoConfig if cls is None else cls
            config = loader.from_pretrained(str(file.parent))
        if overrides:
            check_config_keys(config, overrides, "config overrides", stage="override")
            apply_config_overrides(config, overrides)
        return config

    def supported_tasks(self, config: PretrainedConfig | DiffusersConfig) -> list[str]:
        """The tasks ``config`` can be built for: its registered ones, else those transformers maps it in."""
        entry = self._models.get(config.model_type)
        if entry is not None:
            return sorted(entry.classes)
        if isinstance(config, DiffusersConfig):
            return [DIFFUSERS_TASK]
        from transformers.models.auto import modeling_auto

        return sorted(
            task for task, name in TASKS.items() if name and type(config) in getattr(modeling_auto, name)
        )

    def architecture_task(self, config: PretrainedConfig | DiffusersConfig) -> str | None:
        """The task whose class for ``config`` is one its ``architectures`` names (what ``save_pretrained``, veomni's
        exports and a training checkpoint's ``hf_files/config.json`` record), or None when it names none of them."""
        if isinstance(config, DiffusersConfig):
            return DIFFUSERS_TASK
        names = set(getattr(config, "architectures", None) or ())
        entry = self._models.get(config.model_type)
        for task in self.supported_tasks(config):
            if entry is not None:
                class_name = entry.classes[task].rpartition(":")[2]
            else:
                from transformers.models.auto import modeling_auto

                try:
                    class_name = getattr(modeling_auto, TASKS[task])[type(config)].__name__  # type: ignore[arg-type]
                except (KeyError, ValueError):
                    continue
            if class_name in names:
                return task
        return None

    def model_class(
        self, config: PretrainedConfig | DiffusersConfig, task: str = "causal_lm", *, backend: str = "veomni"
    ) -> ResolvedModel:
        """The modeling class for ``config`` and ``task``.

        With ``backend="veomni"`` a registered model type uses its registered class (no fallback: a missing task
        or a broken import is an error); an unregistered one uses transformers' Auto mapping for ``task`` (for
        diffusers, ``diffusers.<_class_name>``) and logs a warning naming the fast paths that are off for it.
        ``backend="hf"`` always takes transformers' (diffusers') own class, registered or not, with no fast paths.
        A task the model does not support is an error naming the model, the task and the tasks it supports.
        """
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; tasks are {sorted(TASKS)}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; backends are {list(BACKENDS)}")
        kind = "_class_name" if isinstance(config, DiffusersConfig) else "model_type"
        model_type = config.model_type
        if (task == DIFFUSERS_TASK) != isinstance(config, DiffusersConfig):
            raise ValueError(
                f"{kind} {model_type!r} does not support task {task!r}; it supports "
                f"{self.supported_tasks(config)}"
            )
        entry = self._models.get(model_type)
        if entry is not None and backend == "veomni":
            if task not in entry.classes:
                raise ValueError(
                    f"{kind} {model_type!r} does not support task {task!r}: it is registered with veomni for "
                    f"tasks {sorted(entry.classes)}"
                )
            cls = _resolve_model(entry.classes[task], entry.library)
            return ResolvedModel(cls, True, entry.fast_paths)  # type: ignore[arg-type]
        if isinstance(config, DiffusersConfig):
            cls = _resolve_model(f"diffusers:{config.class_name}", "diffusers")
            if not isinstance(cls, type):
                raise ValueError(f"diffusers.{config.class_name} (from {config.source}) is not a model class")
        else:
            cls = self._auto_class(config, task)
        if backend == "hf":
            return ResolvedModel(cls, False, frozenset())
        # Ulysses SP through HF's attention interface is right only when every attention call sees the sliced
        # token sequence: a text decoder. A composite's towers (a ViT's per-image calls) would be taken for shards.
        text_only = task in ("causal_lm", "base") and not isinstance(config, DiffusersConfig)
        fast = {"sp"} if text_only and getattr(cls, "_supports_attention_backend", False) else set()
        off = [FAST_PATHS[p] for p in FAST_PATHS if p not in fast]
        logger.warning(
            "%s %r is not registered with veomni: using %s.%s (%s). Off for this model: %s.%s",
            kind,
            model_type,
            cls.__module__.split(".")[0],
            cls.__name__,
            TASKS[task] or "diffusers' class of that name",
            "; ".join(off),
            " Ulysses SP still works through HF's attention interface." if fast else "",
        )
        return ResolvedModel(cls, False, frozenset(fast))

    def _auto_class(self, config: PretrainedConfig, task: str) -> type:
        from transformers.models.auto import modeling_auto

        mapping_name = TASKS[task]
        try:
            return getattr(modeling_auto, mapping_name)[type(config)]  # type: ignore[arg-type]
        except (KeyError, ValueError) as err:
            registered = "" if config.model_type in self._models else " is not registered with veomni and"
            raise ValueError(
                f"model_type {config.model_type!r}{registered} does not support task {task!r}: transformers has no "
                f"{mapping_name} class for {type(config).__name__}; it supports {self.supported_tasks(config)}"
            ) from err

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


def _fast_paths(name: str, fast_paths: frozenset[str] | set[str]) -> frozenset[str]:
    unknown = set(fast_paths) - set(FAST_PATHS)
    if unknown:
        raise ValueError(f"{name!r}: unknown fast paths {sorted(unknown)}; known {sorted(FAST_PATHS)}")
    return frozenset(fast_paths)


def _resolve_model(target: str, library: str) -> object:
    try:
        return resolve_target(target)
    except ImportError as err:
        # A diffusers entry imports diffusers when first resolved; say so plainly when it is not installed.
        if library == "diffusers" and importlib.util.find_spec("diffusers") is None:
            raise ImportError(
                f"{target!r} is a diffusers model and diffusers is not installed: install the extra "
                "(pip install 'veomni-models[diffusers]')"
            ) from err
        raise


def _diffusers_overrides(config: DiffusersConfig, overrides: Mapping[str, object]) -> DiffusersConfig:
    # Diffusers configs are the keyword arguments of the class's __init__, all written to config.json; a key
    # the file lacks is most likely a typo (the class is not imported here to check its signature).
    unknown = sorted(set(overrides) - set(config.values))
    if unknown:
        import difflib

        hints = {k: difflib.get_close_matches(k, [str(v) for v in config.values], n=1) for k in unknown}
        listed = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise ValueError(
            f"config overrides: {listed} not in the diffusers config of {config.class_name!r} ({config.source})"
        )
    if not overrides:
        return config
    return attrs.evolve(config, values={**config.values, **overrides})


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


def register_family(registry: ModelRegistry, family: ModelFamily) -> None:
    """Register every model type of ``family`` (`veomni.models.family.ModelFamily`) in ``registry``."""
    for spec in family.model_types:
        if spec.library == "diffusers":
            ((task, target),) = spec.classes.items()
            if task != DIFFUSERS_TASK:
                raise ValueError(
                    f"diffusers model {spec.model_type!r}: its one task is {DIFFUSERS_TASK!r}, not {task!r}"
                )
            registry.register_diffusers(spec.model_type, target, fast_paths=spec.fast_paths)
            continue
        assert spec.config is not None  # checked by ModelTypeSpec
        registry.register_config(spec.model_type, spec.config)
        if spec.classes:
            registry.register_model(spec.model_type, spec.classes, fast_paths=spec.fast_paths)


def _builtin_registry() -> ModelRegistry:
    from veomni.models.families import FAMILIES

    registry = ModelRegistry()
    for family in FAMILIES:
        register_family(registry, family)
    return registry


MODELS = _builtin_registry()
"""The default registry, filled at import from veomni's families (`veomni.models.families.FAMILY_MODULES`)."""


def config_for_class(config: PretrainedConfig, cls: type) -> PretrainedConfig:
    """The config ``cls`` is built from: a composite config's text config for a text-only class of it (a Qwen3.5
    VLM checkpoint as a causal LM), as transformers' auto classes hand it; else ``config`` itself."""
    text_config_class = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text_config_class is not None and getattr(cls, "config_class", None) is text_config_class:
        return config.get_text_config()
    return config
