"""The ``data`` section of a training recipe (`veomni.train.recipe.Recipe`): what rows are read, in which format,
how they become token samples. Its fields are documented in their metadata like the other sections'
(`veomni.train.recipe.sections`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from typing import Any, Literal

import attrs

from veomni.train.recipe.data_sources import check_sources, resolve_source_paths
from veomni.train.recipe.parse import RecipeError
from veomni.train.recipe.sections import _field

# Keys of data.dataset that hold local paths (resolved when the recipe is loaded, as other paths are); its ``path``
# is a builder name (json), a Hub id or a directory, resolved only when it names an existing local path.
DATASET_PATH_KEYS = ("data_files", "data_dir", "cache_dir")


def resolve_dataset_paths(value: Any, resolve: Callable[[Any], Any]) -> Any:
    """``data.dataset`` with its local paths made absolute (`DATASET_PATH_KEYS`; ``path`` when it exists here)."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for key in DATASET_PATH_KEYS:
        item = out.get(key)
        if isinstance(item, str):
            out[key] = resolve(item)
        elif isinstance(item, list | tuple):
            out[key] = [resolve(v) if isinstance(v, str) else v for v in item]
        elif isinstance(item, dict):
            out[key] = {
                k: resolve(v) if isinstance(v, str) else [resolve(x) for x in v] for k, v in item.items()
            }
    path = out.get("path")
    if isinstance(path, str) and not _is_url(path):
        local = os.path.expanduser(path)
        if path.startswith("builtin://") or os.path.exists(local):
            out["path"] = resolve(path)
    return out


def _is_url(value: str) -> bool:
    return "://" in value and not value.startswith("builtin://")


def _check_dataset(spec: dict) -> None:
    """data.dataset: load_dataset's arguments; ``path`` required, the keys named in load_dataset's signature typed
    as it takes them (others are builder options, which the builder checks)."""
    if not isinstance(spec.get("path"), str) or not spec["path"]:
        raise RecipeError(
            f"data.dataset: needs path (a builder name such as json or parquet, a directory or a Hub id); found {spec}"
        )
    for key in ("split", "name", "revision", "cache_dir", "data_dir"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise RecipeError(f"data.dataset.{key}: expected a string, found {spec[key]!r}")
    if not isinstance(spec.get("streaming", False), bool):
        raise RecipeError(f"data.dataset.streaming: expected true or false, found {spec['streaming']!r}")
    close = difflib.get_close_matches
    for key in spec:
        typo = close(
            key, ["data_files", "data_dir", "split", "streaming", "cache_dir", "revision", "name"], n=1
        )
        if typo and typo[0] != key and key not in ("path", "storage_options", "token", "num_proc"):
            raise RecipeError(f"data.dataset: unknown key {key!r} (did you mean {typo[0]!r}?)")


@attrs.frozen(kw_only=True)
class DataSection:
    train_files: tuple[str, ...] = _field(
        (),
        "training data (a list): .jsonl, .parquet and .arrow files, globs, directories of them, save_to_disk "
        "directories, and URLs of any of these (s3://, gs://, hdfs://, https://, file://: read through fsspec); "
        "give this or data.dataset",
        path=True,
    )
    dataset: dict | None = _field(
        None,
        "instead of data.train_files: the arguments of datasets.load_dataset, e.g. {path: json, data_files: "
        "[a.jsonl], split: train} or {path: org/name, split: train}; streaming: true reads an IterableDataset "
        "without an index (docs/train.md, HF datasets)",
        path=resolve_dataset_paths,
    )
    sources: tuple[dict, ...] = _field(
        (),
        "instead of data.train_files / data.dataset: a mixture, a list of {name, files | dataset, weight | epochs} "
        "(weight: the source's share of the tokens; epochs: passes over it per round of the mixture), each "
        "optionally with its own format, columns, kind, file_format, text_field, messages_field, loss_mask_field "
        "(docs/train.md, Mixtures)",
        path=resolve_source_paths,
    )
    eval_files: tuple[str, ...] = _field(
        (), "evaluation data files, read whole every train.eval_interval steps", path=True
    )
    file_format: Literal["auto", "jsonl", "parquet", "arrow"] = _field(
        "auto",
        "file format; auto decides by extension (.jsonl/.json: jsonl, .parquet: parquet, .arrow: arrow); "
        "save_to_disk directories are recognised by their files",
    )
    format: str | None = _field(
        None,
        "row format preset, converted to the rows of data.kind as they are read: sharegpt (conversations of "
        "from/value), alpaca (instruction/input/output), openai (messages with content parts, weight), llava "
        "(image + conversations with <image>; kind multimodal), messages (native role/content rows), text (one "
        "string per row), pretokenized (input_ids with optional labels or loss_mask, no tokenizer call); None: "
        "rows already in the shape of data.kind (docs/train.md, Format presets)",
    )
    columns: dict = _field(
        dict,
        "with data.format: the dataset's names for the columns (and message keys) the preset reads, as "
        "{preset_name: dataset_name}, e.g. {conversations: dialog, from: speaker}",
        factory=True,
    )
    kind: str = _field(
        "conversation",
        "text: pre-training on one string per row, every token trained; conversation: role/content messages "
        "rendered by the tokenizer's chat template; multimodal: conversations whose content may list text, "
        "image and video parts, expanded by the model's image and video processors (model.task=vlm); dit: rows of "
        "{video: <frames directory or list of frame files>, caption} or {image: <file>, caption} (model.task=dit); "
        "dit_latents: the latents.jsonl of veomni-dit-embed (conditions encoded offline, model.task=dit); or a "
        "user's data kind: a name registered with veomni.train.data.kinds.register_data_kind, or "
        "'package.module:Factory'",
    )
    media_root: str | None = _field(
        None,
        "kind=multimodal, dit: directory that relative image/frame paths in the rows are read from (dit: None "
        "reads them relative to the data file's directory)",
        path=True,
    )
    patches_per_micro_batch: int | None = _field(
        None,
        "kind=multimodal: vision patches one micro-batch may hold (the second packing budget beside "
        "train.tokens_per_micro_batch; None: no limit); a row above it is an error naming it",
    )
    video_fps: float | None = _field(
        None,
        "kind=multimodal: frames per second sampled from video files, and the rate a frame-list video without "
        "its own fps was taken at (None: the model's video processor config, fps)",
    )
    video_max_frames: int | None = _field(
        None,
        "kind=multimodal: most frames sampled from one video file; a frame list above it is an error (None: the "
        "model's video processor config, max_frames)",
    )
    video_frame_pixels: tuple[int, int] | None = _field(
        None,
        "kind=multimodal, model.task=omni: [min, max] pixels of one resized video frame (the processor call's "
        "videos_kwargs size; None: the thinker's processor's own, 128 to 768 merged patches: of 28 x 28 pixels for "
        "Qwen2.5-Omni, 32 x 32 for Qwen3-Omni-MoE)",
    )
    use_audio_in_video: bool = _field(
        False,
        "kind=multimodal, model.task=omni: decode every video file's audio track and interleave it with the "
        "video's frames by time (the processor's use_audio_in_video: per seconds_per_chunk chunk for Qwen2.5-Omni, "
        "token by token for Qwen3-Omni-MoE); a video without audio is an error",
    )
    text_field: str = _field("text", "kind=text: the row's field holding the text")
    messages_field: str = _field("messages", "kind=conversation: the row's field holding the message list")
    chat_template: str | None = _field(
        None,
        "kind=conversation, multimodal: the chat template to render conversations with, replacing the tokenizer's "
        "own and saved with the HF export: a built-in name (chatml, qwen3, qwen3_keep_thinking) or a Jinja file "
        "(None: the tokenizer's)",
    )
    loss_mask_field: str | None = _field(
        "loss_mask",
        "kind=conversation: per-message field (0/1 or bool) that overrides the default loss choice",
    )
    assistant_only_loss: bool = _field(
        True, "kind=conversation: train on assistant messages only (the role headers are never trained)"
    )
    add_eos: bool = _field(True, "kind=text: append the tokenizer's EOS token to every text")
    max_seq_len: int = _field(2048, "longest sample in tokens (at most train.tokens_per_micro_batch)")
    overlong: Literal["truncate", "drop", "error"] = _field(
        "truncate",
        "a sample longer than max_seq_len: keep its first max_seq_len tokens, leave it out, or stop with an "
        "error naming file and row (counts are reported by the data summary)",
    )
    on_bad_row: Literal["error", "skip"] = _field(
        "error",
        "a row that cannot be read or encoded (invalid JSON, a malformed conversation, a missing or corrupt image, "
        "placeholders not matching images, an image over data.patches_per_micro_batch): stop with an error "
        "naming file and row, or leave it out and report it (per kind at startup, in the data summary and "
        "metrics.jsonl); over-long rows follow data.overlong instead",
    )
    max_bad_fraction: float = _field(
        0.01,
        "on_bad_row=skip: the most bad rows a dataset may hold, as a fraction of its rows; more (or every row) "
        "is an error, since that is a broken path or field rather than a few broken rows",
    )
    index_cache: str | None = _field(
        None,
        "a directory caching each dataset's exact token index, keyed by its files, the tokenizer and chat template, "
        "and these settings: a later start or resume with the same key reads it instead of tokenising every row "
        "(None: no cache)",
        path=True,
    )
    shuffle: bool = _field(True, "shuffle samples every epoch (seeded by train.seed and the epoch)")
    num_workers: int = _field(2, "DataLoader worker processes that read, tokenise and pack (0: in process)")

    def __attrs_post_init__(self) -> None:
        # Imported here: the data kinds live with the data pipeline (a user's import-path kind is imported now).
        from veomni.train.data.kinds import data_kind

        try:
            data_kind(self.kind)
        except ValueError as err:
            raise RecipeError(str(err)) from None
        given = [bool(self.train_files), self.dataset is not None, bool(self.sources)]
        if sum(given) != 1:
            raise RecipeError(
                "data: give the training data as data.train_files (a non-empty list), data.dataset or data.sources, "
                f"exactly one; found train_files={list(self.train_files)}, dataset={self.dataset}, "
                f"sources={list(self.sources)}"
            )
        if self.sources:
            check_sources(self)
        if self.dataset is not None:
            _check_dataset(self.dataset)
            if self.dataset.get("streaming") and self.shuffle:
                raise RecipeError(
                    "data.shuffle: a streaming dataset (data.dataset.streaming: true) is read in stream order, since "
                    "a shuffle buffer is not a resumable position; set data.shuffle: false (shuffle the corpus "
                    "beforehand)"
                )
            if self.dataset.get("streaming") and self.kind not in ("text", "conversation"):
                raise RecipeError(
                    f"data.dataset.streaming: streams train data.kind text or conversation, found {self.kind!r}"
                )
        if self.max_seq_len < 2:
            raise RecipeError(f"data.max_seq_len: expected >= 2, found {self.max_seq_len}")
        if self.num_workers < 0:
            raise RecipeError(f"data.num_workers: expected >= 0, found {self.num_workers}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise RecipeError(f"data.max_bad_fraction: expected 0 <= x <= 1, found {self.max_bad_fraction}")
        if self.patches_per_micro_batch is not None and self.patches_per_micro_batch < 1:
            raise RecipeError(
                f"data.patches_per_micro_batch: expected >= 1, found {self.patches_per_micro_batch}"
            )
        if self.video_fps is not None and not self.video_fps > 0:
            raise RecipeError(f"data.video_fps: expected > 0, found {self.video_fps}")
        if self.video_max_frames is not None and self.video_max_frames < 1:
            raise RecipeError(f"data.video_max_frames: expected >= 1, found {self.video_max_frames}")
        pixels = self.video_frame_pixels
        if pixels is not None and not 0 < pixels[0] <= pixels[1]:
            raise RecipeError(
                f"data.video_frame_pixels: expected [min, max] with 0 < min <= max, found {list(pixels)}"
            )
        if self.use_audio_in_video and self.kind != "multimodal":
            raise RecipeError(
                f"data.use_audio_in_video: videos are read by data.kind=multimodal (model.task=omni) only, but "
                f"data.kind is {self.kind!r}"
            )
        if self.chat_template is not None:
            self._check_chat_template()
        self._check_format()
        # The token pipelines of kind text and conversation read none of the media fields: set, they would be ignored.
        readers = {"media_root": ("multimodal", "dit"), "patches_per_micro_batch": ("multimodal",),
                   "video_fps": ("multimodal",), "video_max_frames": ("multimodal",),
                   "video_frame_pixels": ("multimodal",)}  # fmt: skip
        for name, kinds in readers.items():
            if getattr(self, name) is not None and self.kind in ("text", "conversation"):
                raise RecipeError(
                    f"data.{name}: read for data.kind {', '.join(kinds)} only, but data.kind is {self.kind!r}; "
                    f"found {getattr(self, name)!r} (remove it)"
                )

    def _check_chat_template(self) -> None:
        from veomni.train.data.chat_template import BUILTIN_CHAT_TEMPLATES

        if self.kind not in ("conversation", "multimodal"):
            raise RecipeError(
                f"data.chat_template: conversations are rendered for data.kind conversation and multimodal only, but "
                f"data.kind is {self.kind!r}; found {self.chat_template!r} (remove it)"
            )
        if self.chat_template not in BUILTIN_CHAT_TEMPLATES and not os.path.isfile(self.chat_template):
            raise RecipeError(
                f"data.chat_template: expected a built-in name ({', '.join(BUILTIN_CHAT_TEMPLATES)}) or a Jinja "
                f"file, found {self.chat_template!r} (no such built-in or file)"
            )

    def _check_format(self) -> None:
        """data.format names a preset for data.kind, and data.columns renames only what the preset reads."""
        from veomni.train.data.presets import PRESETS

        if self.format is None:
            if self.columns:
                raise RecipeError(
                    f"data.columns: renames the columns a data.format preset reads, but data.format is null; found "
                    f"{self.columns} (set data.format, or name the field with data.messages_field / text_field)"
                )
            return
        if self.format in ("auto", "jsonl", "parquet"):
            raise RecipeError(
                f"data.format: {self.format!r} is a file format; data.format names the row format "
                f"({', '.join(PRESETS)}) and the file format is data.file_format"
            )
        if self.format not in PRESETS:
            close = difflib.get_close_matches(self.format, list(PRESETS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(
                f"data.format: expected one of {list(PRESETS)} or null, found {self.format!r}{hint}"
            )
        preset = PRESETS[self.format]
        if self.kind not in preset.kinds:
            raise RecipeError(
                f"data.format: {self.format} rows are converted for data.kind in {list(preset.kinds)}, but "
                f"data.kind is {self.kind!r}"
                + ("; LLaVA rows hold images: use data.kind: multimodal" if self.format == "llava" else "")
            )
        for key, value in self.columns.items():
            if key not in preset.names:
                close = difflib.get_close_matches(key, list(preset.names), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise RecipeError(
                    f"data.columns: {key!r} is not a column the {self.format} preset reads{hint}; it reads "
                    f"{list(preset.names)}"
                )
            if not isinstance(value, str) or not value:
                raise RecipeError(f"data.columns.{key}: expected a column name, found {value!r}")
        if self.format == "pretokenized" and self.chat_template is not None:
            raise RecipeError(
                f"data.chat_template: pretokenized rows are not rendered; found {self.chat_template!r} (remove it)"
            )
