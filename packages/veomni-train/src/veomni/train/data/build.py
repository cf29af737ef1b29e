"""Build the data pipeline of a recipe: row sources, the encoder, the exact index, train and eval iterators."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from veomni.models.family import DataRules
from veomni.train.data.encode import Encoder
from veomni.train.data.index_cache import cached_index, index_key, store_index
from veomni.train.data.loader import DataTopology, EvalData, TrainData
from veomni.train.data.mixture import MixtureData, MixturePart
from veomni.train.data.plan import DatasetIndex, index_dataset
from veomni.train.data.presets import FormattedSource, open_rows, row_format
from veomni.train.data.row_formats import check_some_media
from veomni.train.data.sources import DataError, RowSource
from veomni.train.data.stream import StreamData
from veomni.train.recipe import DataSection, Recipe

log = logging.getLogger(__name__)


def encoder_for(
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    *,
    vision_metadata: Callable[..., Any] | None = None,
    data_rules: DataRules | None = None,
    model_config: Any = None,
) -> Encoder:
    """The `Encoder` of the recipe's ``data.kind`` (`veomni.train.data.kinds`: a built-in, registered or
    import-path kind), given the model-side inputs of the task (`veomni.train.tasks.vision.VlmTask.data_options`).

    ``multimodal`` rows are laid out by the model's family (``data_rules``, `veomni.models.family.DataRules`: the
    encoder kind of `veomni.train.data.encoders`, the position and video rules, resolved with ``model_config``);
    the image and video processors are loaded from the tokenizer's directory (``tokenizer.name_or_path``:
    model.tokenizer, else model.weights), and batches are collated with the model's ``vision_metadata`` (its
    host-side vision layout; None for text data). A multimodal run for a model without data rules is a `DataError`
    naming its ``model_type`` and the families that declare some."""
    from veomni.train.data.kinds import build_row_encoder

    return build_row_encoder(  # type: ignore[no-any-return]
        data, tokenizer, vision_metadata=vision_metadata, data_rules=data_rules, model_config=model_config
    )


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id used for SP padding (never trained): the pad token, else EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def index_files(
    data: DataSection,
    files: Sequence[str],
    encoder: Encoder,
    *,
    group: dist.ProcessGroup | None = None,
    what: str = "data",
) -> tuple[RowSource | FormattedSource, DatasetIndex]:
    """Open ``files`` and tokenise every row once (split over ``group``'s ranks when given; read from
    ``data.index_cache`` instead when it holds this index, `veomni.train.data.index_cache`); bad rows follow
    ``data.on_bad_row`` and, when skipped, are logged per kind, and rows that ``data.overlong`` left out or cut are
    counted in a warning (``what`` names the file list)."""
    source = open_rows(data, files, encoder)
    key = None if data.index_cache is None else index_key(data, source, encoder)
    index, cache_path = cached_index(data.index_cache, key, what, group)
    if index is None:
        index = index_dataset(
            source,
            encoder,
            max_seq_len=data.max_seq_len,
            overlong=data.overlong,
            num_workers=data.num_workers,
            group=group,
            on_bad_row=data.on_bad_row,
            max_bad_fraction=data.max_bad_fraction,
        )
        store_index(cache_path, index, group, what)
    if data.kind == "multimodal":
        good = np.setdiff1d(np.arange(index.num_rows), index.bad.rows)
        check_some_media(source, data.messages_field, good, what)
    rank0 = group is None or dist.get_rank(group) == 0
    # The training data's counts are also in the run's start-up summary; the evaluation data's only here.
    over = index.dropped or index.truncated
    if over and rank0:
        log.warning(
            "%s: %d of %d rows are longer than data.max_seq_len=%d and were %s (data.overlong=%s)",
            what, over, index.num_rows, data.max_seq_len, "left out" if index.dropped else "truncated",
            data.overlong,
        )  # fmt: skip
    if len(index.bad) and rank0:
        log.warning(
            "%s: left out %d bad row(s) of %d (data.on_bad_row=skip, at most %s allowed):",
            what, len(index.bad), index.num_rows, data.max_bad_fraction,
        )  # fmt: skip
        for line in index.bad.report():
            log.warning("%s: %s", what, line)
    return source, index


def check_trained_tokens(
    source: RowSource, index: DatasetIndex, files: Sequence[str], what: str, encoder: Encoder | None = None
) -> None:
    """Data whose every label is masked trains nothing: a `DataError` naming the files. Files holding no row or
    no trained token beside others that do are named in a warning. With ``encoder``, trained tokens must also
    include content (`check_content_tokens`), not only the template's end-of-turn and special tokens."""
    starts = np.cumsum([0] + [len(f) for f in source.files]).tolist()
    spans = list(zip(starts[:-1], starts[1:], strict=True))
    per_file = [int(index.trained[a:b].sum()) for a, b in spans]
    if sum(per_file) == 0:
        raise DataError(
            f"{what}: no trained token in {list(files)} ({index.num_rows} rows, {index.total_tokens} tokens, every "
            "label masked); check data.kind, data.assistant_only_loss and the rows' loss-mask field"
        )
    # Per opened file: a glob or a directory in ``files`` stands for several.
    for path, trained, (a, b) in zip([f.path for f in source.files], per_file, spans, strict=True):
        if b == a:
            log.warning("%s: %s holds no row", what, path)
        elif trained == 0:
            log.warning("%s: %s holds %d rows but no trained token (every label masked)", what, path, b - a)
    if encoder is not None:
        check_content_tokens(source, index, encoder, files, what)


# Rows re-tokenised first, spread over the data; the rest only when none of them has content.
CONTENT_SAMPLE = 64


def check_content_tokens(
    source: RowSource, index: DatasetIndex, encoder: Encoder, files: Sequence[str], what: str
) -> None:
    """Refuse data whose trained tokens are all the chat template's own (end-of-turn and other special tokens,
    whitespace after them): with every assistant turn empty it would train the model to end its turns at once.

    Rows with trained tokens are tokenised again (text only, no pixel decoded): `CONTENT_SAMPLE` spread over the
    data first, all of them only when none of those holds a content token (a non-special token that decodes to
    more than whitespace). Raises a `DataError` naming the files when there is none."""
    rows = np.flatnonzero(index.trained > 0)
    if not rows.size:
        return
    spread = np.unique(np.linspace(0, rows.size - 1, min(CONTENT_SAMPLE, rows.size)).round().astype(np.int64))
    order = [*rows[spread].tolist(), *np.delete(rows, spread).tolist()]
    tokenizer = encoder.tokenizer
    special = set(tokenizer.all_special_ids)
    blank: dict[int, bool] = {}
    tokens = getattr(encoder, "text_tokens", encoder)  # multimodal encoders: the text without the pixels
    for row in order:
        try:
            ids, trained = tokens(source[row], source.ref(row))[:2]
        except DataError:
            continue  # bad rows are the index's business (data.on_bad_row)
        for token in set(ids[trained].tolist()) - special:
            if token not in blank:
                blank[token] = not tokenizer.decode([token]).strip()
            if not blank[token]:
                return
    raise DataError(
        f"{what}: the {index.total_trained_tokens} trained tokens of {list(files)} ({rows.size} rows) are all the "
        "chat template's end-of-turn or special tokens, no content: every trained message (the assistant turns, "
        "with data.assistant_only_loss) is empty. Training would only teach the model to end its turns at once; "
        "check the rows' assistant turns (their field names: docs/train.md, Row formats)"
    )


def check_task_and_kind(recipe: Recipe, name: str | None = None) -> None:
    """``data.kind`` (or the kind ``name``, a mixture source's) is one the task trains on: listed by the task's
    ``data_kinds``, or a data kind that names the task itself (`veomni.train.data.kinds.DataKind.tasks`); a
    `DataError` otherwise."""
    from veomni.train.data.kinds import data_kind
    from veomni.train.tasks import task_class

    name = recipe.data.kind if name is None else name
    task = task_class(recipe.model.task)
    kinds = task.data_kinds
    if name in kinds:
        return
    try:
        kind = data_kind(name)
    except ValueError as err:
        raise DataError(str(err)) from None
    if task.name not in kind.tasks:
        raise DataError(
            f"model.task={recipe.model.task!r} trains on data.kind in {list(kinds)} (or a data kind naming the "
            f"task), found {name!r}"
            + (f", which trains with model.task in {list(kind.tasks)}" if kind.tasks else "")
        )


def build_train_data(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    topology: DataTopology,
    *,
    group: dist.ProcessGroup | None = None,
    pin_memory: bool = False,
    vision_metadata: Callable[..., Any] | None = None,
    data_rules: DataRules | None = None,
    model_config: Any = None,
) -> TrainData | StreamData | MixtureData:
    """The resumable training iterator of this rank (indexes the training files first; every rank must call it
    when ``group`` is given). ``vision_metadata``, ``data_rules``, ``model_config``: the task's model-side inputs
    (`encoder_for`)."""
    options = dict(vision_metadata=vision_metadata, data_rules=data_rules, model_config=model_config)
    if recipe.data.sources:
        return _mixture_data(recipe, tokenizer, topology, group, pin_memory, options)
    check_task_and_kind(recipe)
    encoder = encoder_for(recipe.data, tokenizer, **options)
    if recipe.data.dataset is not None and recipe.data.dataset.get("streaming"):
        return _stream_data(recipe, encoder, topology, pad_token_id(tokenizer), pin_memory)
    what = "data.train_files" if recipe.data.train_files else "data.dataset"
    source, index = index_files(recipe.data, recipe.data.train_files, encoder, group=group, what=what)
    check_trained_tokens(source, index, [f.path for f in source.files], what, encoder)
    return TrainData(
        source,
        encoder,
        index,
        topology=topology,
        tokens_per_micro_batch=recipe.train.tokens_per_micro_batch,
        grad_accum=recipe.grad_accum(topology.dp_size),
        seed=recipe.train.seed,
        shuffle=recipe.data.shuffle,
        max_seq_len=recipe.data.max_seq_len,
        overlong=recipe.data.overlong,
        num_workers=recipe.data.num_workers,
        pad_id=pad_token_id(tokenizer),
        pin_memory=pin_memory,
        patches_per_micro_batch=recipe.data.patches_per_micro_batch,
        on_bad_row=recipe.data.on_bad_row,
    )


def _mixture_data(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    topology: DataTopology,
    group: dist.ProcessGroup | None,
    pin_memory: bool,
    options: dict[str, Any],
) -> MixtureData:
    """The `MixtureData` of ``data.sources``: each source indexed as one dataset is, with its own section."""
    from veomni.train.recipe.data_sources import source_section

    parts = []
    for i, entry in enumerate(recipe.data.sources):
        data = source_section(recipe.data, i)
        check_task_and_kind(recipe, data.kind)
        encoder = encoder_for(data, tokenizer, **options)
        what = f"data.sources[{i}] ({entry['name']})"
        source, index = index_files(data, data.train_files, encoder, group=group, what=what)
        check_trained_tokens(source, index, [f.path for f in source.files], what, encoder)
        parts.append(
            MixturePart(entry["name"], source, encoder, index, entry.get("weight"), entry.get("epochs"))
        )
    return MixtureData(
        parts,
        topology=topology,
        tokens_per_micro_batch=recipe.train.tokens_per_micro_batch,
        grad_accum=recipe.grad_accum(topology.dp_size),
        seed=recipe.train.seed,
        shuffle=recipe.data.shuffle,
        max_seq_len=recipe.data.max_seq_len,
        overlong=recipe.data.overlong,
        num_workers=recipe.data.num_workers,
        pad_id=pad_token_id(tokenizer),
        pin_memory=pin_memory,
        patches_per_micro_batch=recipe.data.patches_per_micro_batch,
        on_bad_row=recipe.data.on_bad_row,
    )


def _stream_data(
    recipe: Recipe, encoder: Encoder, topology: DataTopology, pad_id: int, pin_memory: bool
) -> StreamData:
    """The `StreamData` of a ``data.dataset`` with ``streaming: true`` (no index: packed as it is read)."""
    from veomni.train.data.hf_sources import describe_spec, load_dataset_spec

    data = recipe.data
    fmt = row_format(data)
    return StreamData(
        load_dataset_spec(data.dataset),
        encoder,
        None if fmt is None else fmt.convert,
        describe_spec(data.dataset),
        topology=topology,
        tokens_per_micro_batch=recipe.train.tokens_per_micro_batch,
        grad_accum=recipe.grad_accum(topology.dp_size),
        max_seq_len=data.max_seq_len,
        overlong=data.overlong,
        pad_id=pad_id,
        num_workers=data.num_workers,
        pin_memory=pin_memory,
        on_bad_row=data.on_bad_row,
    )


def build_eval_data(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    topology: DataTopology,
    *,
    group: dist.ProcessGroup | None = None,
    pin_memory: bool = False,
    vision_metadata: Callable[..., Any] | None = None,
    data_rules: DataRules | None = None,
    model_config: Any = None,
) -> EvalData | None:
    """The evaluation pass of this rank, or None when the recipe has no eval files (model-side inputs as for
    `build_train_data`)."""
    if not recipe.data.eval_files:
        return None
    encoder = encoder_for(
        recipe.data,
        tokenizer,
        vision_metadata=vision_metadata,
        data_rules=data_rules,
        model_config=model_config,
    )
    source, index = index_files(
        recipe.data, recipe.data.eval_files, encoder, group=group, what="data.eval_files"
    )
    check_trained_tokens(source, index, recipe.data.eval_files, "data.eval_files", encoder)
    return EvalData(
        source,
        encoder,
        index,
        topology=topology,
        tokens_per_micro_batch=recipe.train.tokens_per_micro_batch,
        max_seq_len=recipe.data.max_seq_len,
        overlong=recipe.data.overlong,
        num_workers=recipe.data.num_workers,
        pad_id=pad_token_id(tokenizer),
        pin_memory=pin_memory,
        patches_per_micro_batch=recipe.data.patches_per_micro_batch,
        on_bad_row=recipe.data.on_bad_row,
    )


def total_steps(recipe: Recipe, train_data: TrainData) -> int:
    """``train.steps``, or the steps of ``train.epochs`` whole epochs of the packed real data."""
    if recipe.train.steps is not None:
        return recipe.train.steps
    return train_data.total_steps(int(recipe.train.epochs or 0))
