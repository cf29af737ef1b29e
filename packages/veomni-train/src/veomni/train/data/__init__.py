"""The packed data pipeline: jsonl/parquet rows -> token samples -> padding-free packed micro-batches.

Start from `build_train_data` / `build_eval_data` (a recipe, a tokenizer and this rank's `DataTopology`), iterate
`TrainData` for `Step` objects (multimodal conversations: `veomni.train.data.multimodal`), and feed each micro-batch to the model with `model_inputs` (its labels are already
shifted). docs/train.md describes the batch layout, the resume guarantees and the over-length policy.
"""

from veomni.train.data.build import (
    build_eval_data,
    build_train_data,
    encoder_for,
    index_files,
    pad_token_id,
    total_steps,
)
from veomni.train.data.encode import (
    ConversationEncoder,
    Encoder,
    Sample,
    TextEncoder,
    build_encoder,
    encode_row,
    load_tokenizer,
)
from veomni.train.data.kinds import data_kind_names, register_data_kind
from veomni.train.data.loader import DataTopology, EvalData, Step, TrainData
from veomni.train.data.multimodal import MultimodalEncoder
from veomni.train.data.multimodal_batch import MediaSample, collate_multimodal
from veomni.train.data.packing import (
    IGNORE_INDEX,
    collate,
    model_inputs,
    padding_batch,
    shifted_labels,
    unpack,
)
from veomni.train.data.plan import DatasetIndex, MicroBatches, epoch_micro_batches, index_dataset, pack_rows
from veomni.train.data.sources import DataError, RowRef, RowSource

__all__ = [
    "IGNORE_INDEX",
    "ConversationEncoder",
    "DataError",
    "DataTopology",
    "DatasetIndex",
    "Encoder",
    "EvalData",
    "MediaSample",
    "MicroBatches",
    "MultimodalEncoder",
    "RowRef",
    "RowSource",
    "Sample",
    "Step",
    "TextEncoder",
    "TrainData",
    "build_encoder",
    "build_eval_data",
    "build_train_data",
    "collate",
    "collate_multimodal",
    "data_kind_names",
    "encode_row",
    "encoder_for",
    "epoch_micro_batches",
    "index_dataset",
    "index_files",
    "load_tokenizer",
    "model_inputs",
    "pack_rows",
    "pad_token_id",
    "padding_batch",
    "register_data_kind",
    "shifted_labels",
    "total_steps",
    "unpack",
]
