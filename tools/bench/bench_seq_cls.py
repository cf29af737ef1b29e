"""Sequence classification fwd+bwd, veomni vs HF transformers: a Qwen3 classifier (Qwen3-0.6B's shape), JSON out.

    python tools/bench/bench_seq_cls.py --out seq_cls.json [--layers 28] [--batch 8] [--seq-len 1024]
        [--num-labels 4] [--attention sdpa] [--size full|tiny] [--contenders hf,veomni_decoder_eager,veomni]

Every contender holds the same weights (initialised once by transformers, seeded) in bf16 on CUDA (``--size tiny``:
two small layers in fp32 on the CPU, the parity check the tests run) and runs the same right-padded batch with
its ``attention_mask`` and one label per row. Contenders, in this order:

- ``hf``: transformers' ``Qwen3ForSequenceClassification`` (attention ``--attention``: HF's own implementation).
- ``veomni_decoder_eager``: veomni's generated class with ``rms_norm``, ``rope`` and ``swiglu`` eager and the
  Triton classification CE: the arithmetic veomni's adapter ran before its decoder was the patched one (upstream's
  decoder ignored the kernels).
- ``veomni``: the generated class with Triton RMSNorm, RoPE, SwiGLU and CE (on a CPU: Triton's interpreter, so
  run ``--size tiny`` with ``TRITON_INTERPRET=1``), attention ``--attention`` through veomni's entry.

A step is ``model(input_ids, attention_mask, labels).loss.backward()`` (gradients set to None before each).
Reported per contender: median fwd+bwd ms, forward ms (no_grad), tokens/s (padded tokens counted), peak extra
memory of one step (CUDA), and errors against ``hf``: loss, logits and the gradients of the score head, the
embeddings and the first layer's q_proj (relative, Frobenius). ``agrees``: every relative error within 2e-2 in bf16
(1e-4 in fp32). ``speedup_vs_hf`` = HF ms / ours ms.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForSequenceClassification

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common lives beside this script
from bench_common import environment, error_text, rel_err, release, timed_row, write_json  # noqa: E402

# Qwen3-0.6B's layer (H 1024, I 3072, 16 query / 8 kv heads of 128, vocab 151,936); tiny: a CPU-sized cut.
SHAPES = {
    "full": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=256),
}  # fmt: skip
CONTENDERS = ("hf", "veomni_decoder_eager", "veomni")
CHECKED_GRADS = ("score.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


def make_config(cli: Any) -> Qwen3Config:
    """The benchmarked classifier's config (``pad_token_id`` 0, untied embeddings)."""
    config = Qwen3Config(
        **SHAPES[cli.size], num_hidden_layers=cli.layers, num_labels=cli.num_labels, pad_token_id=0,
        max_position_embeddings=max(4096, cli.seq_len), tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = cli.attention
    return config


def make_batch(cli: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded rows (lengths from S/2 to S), their padding mask and labels, seeded: ``input_ids`` ``[B, S]``."""
    gen = torch.Generator().manual_seed(7)
    vocab = SHAPES[cli.size]["vocab_size"]
    ids = torch.randint(1, vocab, (cli.batch, cli.seq_len), generator=gen)
    lengths = torch.randint(cli.seq_len // 2, cli.seq_len + 1, (cli.batch,), generator=gen)
    mask = torch.arange(cli.seq_len)[None] < lengths[:, None]
    ids = ids.masked_fill(~mask, 0)
    labels = torch.randint(0, cli.num_labels, (cli.batch,), generator=gen)
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.long().to(device),
        "labels": labels.to(device),
    }


def build(name: str, config: Qwen3Config, state: dict[str, torch.Tensor], cli: Any, dtype, device) -> Any:
    """One contender's model, holding a copy of ``state``, ready to run."""
    from veomni.kernels import OpsConfig
    from veomni.models.hf.kernel_hooks import apply_ops
    from veomni.models.qwen3.generated.patched_modeling_qwen3 import (
        Qwen3ForSequenceClassification as VeomniQwen3ForSequenceClassification,
    )

    model_cls = Qwen3ForSequenceClassification if name == "hf" else VeomniQwen3ForSequenceClassification
    model = model_cls(config)
    model.load_state_dict(state, strict=True)
    model = model.to(device=device, dtype=dtype).train()
    if name != "hf":
        decoder = "triton" if name == "veomni" else "eager"
        apply_ops(model, OpsConfig(attention=cli.attention, rms_norm=decoder, rope=decoder, swiglu=decoder,
                                   cross_entropy="triton"))  # fmt: skip
    return model


def run_contender(name: str, model: Any, batch: dict, cli: Any, device: torch.device) -> dict[str, Any]:
    """Time one contender and return its row plus the tensors compared against ``hf``."""

    def step():
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return out

    def forward():
        return model(**batch, use_cache=False)

    out = step()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if n in CHECKED_GRADS}
    row = {"impl": name, **timed_row(step, forward, device, cli.reps)}
    row["tokens_per_s"] = batch["input_ids"].numel() / (row["ms"] / 1e3)
    kernels = getattr(model, "veomni_kernels", None)
    if kernels is not None:
        row["ops"] = {f: getattr(kernels.config, f) for f in ("attention", "rms_norm", "rope", "swiglu",
                                                              "cross_entropy")}  # fmt: skip
    row["decoder_class"] = f"{type(model.model).__module__}.{type(model.model).__name__}"
    return {
        "row": row,
        "loss": out.loss.detach().float(),
        "logits": out.logits.detach().float(),
        "grads": grads,
    }


def bench(cli: Any) -> dict[str, Any]:
    """Run every contender on one device; returns (and writes after each row) the JSON result."""
    device = torch.device("cuda" if cli.size == "full" else "cpu")
    dtype = torch.bfloat16 if cli.size == "full" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    config = make_config(cli)
    torch.manual_seed(0)
    state = Qwen3ForSequenceClassification(config).state_dict()
    batch = make_batch(cli, device)
    result: dict[str, Any] = {
        "bench": "seq_cls", "env": environment(device), "dtype": str(dtype).removeprefix("torch."),
        "shape": {**SHAPES[cli.size], "layers": cli.layers, "batch": cli.batch, "seq_len": cli.seq_len,
                  "num_labels": cli.num_labels, "attention": cli.attention},
        "rows": [],
    }  # fmt: skip
    reference = None
    for name in cli.contenders:
        try:
            model = build(name, config, state, cli, dtype, device)
            got = run_contender(name, model, batch, cli, device)
        except Exception as err:  # a failing contender is a result, not a crash
            result["rows"].append({"impl": name, "error": error_text(err)})
            write_json(cli.out, result)
            continue
        finally:
            model = None
            release(device)
        row = got["row"]
        if reference is None:
            reference = got
        row["reference"] = reference["row"]["impl"]
        errs = {
            "loss": rel_err(got["loss"], reference["loss"]),
            "logits": rel_err(got["logits"], reference["logits"]),
        }
        errs |= {f"d_{n}": rel_err(got["grads"][n], reference["grads"][n]) for n in CHECKED_GRADS}
        row["errors"] = errs
        row["agrees"] = all(e <= tol for e in errs.values())
        hf = next(
            (r for r in result["rows"] if r["impl"] == "hf" and "ms" in r), None
        )  # None: not run, or failed
        if name != "hf" and hf is not None:
            row["speedup_vs_hf"] = hf["ms"] / row["ms"]
        result["rows"].append(row)
        write_json(cli.out, result)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--size", choices=sorted(SHAPES), default="full")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (full: 28, tiny: 2)")
    parser.add_argument("--batch", type=int, default=None, help="rows (full: 8, tiny: 3)")
    parser.add_argument("--seq-len", type=int, default=None, help="padded row length (full: 1024, tiny: 16)")
    parser.add_argument("--num-labels", type=int, default=4)
    parser.add_argument("--attention", default="sdpa", help="HF and veomni attention backend name")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated, run in this order"
    )
    cli = parser.parse_args(argv)
    cli.contenders = cli.contenders.split(",")
    unknown = sorted(set(cli.contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    full = cli.size == "full"
    cli.layers = cli.layers or (28 if full else 2)
    cli.batch = cli.batch or (8 if full else 3)
    cli.seq_len = cli.seq_len or (1024 if full else 16)
    if full and not torch.cuda.is_available():
        parser.error("--size full needs a CUDA GPU (use --size tiny on a CPU)")
    return cli


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point: parse, run, print one line per contender."""
    cli = parse_args(argv)
    result = bench(cli)
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['impl']:>22}: {row['error']}")
        else:
            print(f"{row['impl']:>22}: {row['ms']:8.2f} ms  agrees={row['agrees']}  "
                  f"speedup_vs_hf={row.get('speedup_vs_hf', 1.0):.2f}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
