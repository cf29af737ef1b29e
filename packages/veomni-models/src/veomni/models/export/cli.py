"""``veomni-export-hf``: convert a DCP training checkpoint of a model to an HF checkpoint (offline, one process).

Example::

    veomni-export-hf ckpt/step_00001000/dcp hf_out --prefix model. --dtype bfloat16

The output (sharded safetensors + index + config.json, with the generation config and the tokenizer / processor
files) loads with plain ``transformers.AutoModelForCausalLM.from_pretrained`` and no veomni import. Config and
files come from the training checkpoint (``step_N/hf_files/``); ``--config`` (the source model's directory) is
needed only for a checkpoint written before the trainer kept them.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` / ``"500MiB"`` / ``"1024"`` -> bytes (decimal units as transformers' ``max_shard_size``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 500MB or 1024, got {text!r}")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"the shard size must be positive, got {text!r}")
    return size


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``veomni-export-hf``."""
    parser = argparse.ArgumentParser(
        prog="veomni-export-hf",
        description="Convert a torch.distributed.checkpoint (DCP) model checkpoint to HF safetensors + config.",
    )
    parser.add_argument("dcp_dir", help="the DCP checkpoint directory")
    parser.add_argument("out_dir", help="where to write the HF checkpoint")
    parser.add_argument(
        "--config",
        help="the model's HF config, a directory with config.json or the file: only for a checkpoint without "
        "step_N/hf_files/ (written before the trainer kept its model's config and tokenizer there), whose "
        "tokenizer / processor files are then taken from the same directory. With hf_files/ the checkpoint's "
        "trained config wins: a given one that differs is set aside with a warning listing the differences",
    )
    parser.add_argument(
        "--prefix",
        default="",
        help="prefix of the model's keys in the checkpoint, e.g. 'model.' when saved as {'model': state_dict}",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: as stored)")
    parser.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", help="safetensors file size limit"
    )
    parser.add_argument(
        "--task",
        default=None,
        help="model class task (causal_lm, image_text_to_text, any_to_any, base, ...); default: inferred, the task "
        "whose class the config's architectures names (the trained one in hf_files/), else the first of causal_lm, "
        "image_text_to_text, any_to_any whose keys match the checkpoint",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 on success, 1 on an error, printed to stderr)."""
    args = build_parser().parse_args(argv)
    # The export logs where its config and tokenizer files come from (the checkpoint's own, or --config's).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from veomni.models.export.hf import export_dcp_to_hf

    try:
        report = export_dcp_to_hf(
            args.dcp_dir,
            args.out_dir,
            config=args.config,
            prefix=args.prefix,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            max_shard_bytes=args.max_shard_size,
            task=args.task,
        )
    except (ValueError, FileNotFoundError, NotImplementedError, ImportError) as err:
        print(f"veomni-export-hf: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(report.files)} safetensors file(s), {report.total_bytes} bytes, to {report.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
