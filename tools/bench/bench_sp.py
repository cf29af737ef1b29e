"""Ulysses sequence parallelism (T5): a Qwen3-8B-class (or Qwen3.5-9B hybrid) model trains long sequences, SP=P
against SP=1, JSON out.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 tools/bench/bench_sp.py --out sp.json
    python3 -m torch.distributed.run --standalone --nproc-per-node 4 tools/bench/bench_sp.py --out hybrid.json \
        --model qwen3_5_9b --sp-lengths "4:65536;1:65536"   # Gated DeltaNet hybrid at 64k (issue 21)
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench/bench_sp.py --out smoke.json \\
        --tiny --precision fp32 --device cpu --sp-lengths "2:256;1:256" --steps 2 --warmup 1   # CPU smoke

Model: Qwen3-8B's published config written inline (max_position_embeddings 131072), or with ``--model qwen3_5_9b``
Qwen3.5-9B's text model (Gated DeltaNet hybrid; fla's kernels on CUDA), RANDOMLY INITIALISED (seeded; a throughput
benchmark). The rest is the trainer's: a `Recipe`, `build_model` with the trainer's FSDP2 policy
over all ranks (dp_shard * sp = world; bf16 compute, fp32 masters and reduce; activation checkpointing),
`build_adamw`, and `veomni.train.loop.train_step` for every step.

``--sp-lengths "4:32768,65536,131072;1:32768,65536,131072"``: SP=4 (dp=1) at three lengths, then SP=1 (dp=4). The
model is built once per SP degree and reused across its lengths (``model_steps_before``: steps it took before).
A failed configuration is recorded as ``{"error": ...}`` and the model rebuilt; after an out-of-memory error the
longer lengths of that SP degree are skipped. The JSON is rewritten after each configuration (an error on only
some ranks can leave the others in a collective until the NCCL watchdog ends the job). ``--append`` adds a
command's configurations to the runs already in ``--out``, to split a long list over several commands.

Data: per step, each SP group trains ONE document of ``seq_len`` random ids seeded by (seed, step, dp rank),
through the trainer's collator (`veomni.train.data.collate`: labels shifted inside the document, contiguous SP
slices, full-row cu_seqlens). ``--same-data`` gives every dp rank dp rank 0's document (parity runs).

Reported: tokens/s per GPU (a step's tokens over all ranks / step time / world), MFU (BENCHMARKS.md's causal
convention via `veomni.train.metrics`; recomputation not counted), peak allocated/reserved memory and step times
(max over ranks), per-step ``losses`` (global token mean) and ``grad_norms``, and ``seq0_losses``: the mean over
dp rank 0's document alone, equal across SP degrees at equal ``seq_len`` and ``model_steps_before``. Then the
SP=P / SP=1 ratios at every length both ran.

Attention: without ``--ops attention=...``, the OpsConfig default (``varlen`` on CUDA): one document per sequence
is a single packed segment, which both the varlen and the sdpa backend run on SDPA's unmasked kernels (cuDNN /
flash). torch's varlen_attn itself measured 25.1% MFU at 128k against SDPA's 37.8% (notebook/benchmarks-log.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers

from veomni.core.compile import compile_stats
from veomni.core.master_weights import master_weights_of
from veomni.core.parallel_state import ParallelState, build_parallel_state
from veomni.kernels import Hardware, detect_hardware
from veomni.train import loop
from veomni.train import recipe as rc
from veomni.train.data import Sample, Step, collate
from veomni.train.flops import attention_layers
from veomni.train.metrics import attention_flops, peak_flops
from veomni.train.optim import Schedule, build_adamw, build_scheduler
from veomni.train.tasks.text import TextTask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_e2e lives beside this script
from bench_common import max_over_ranks  # noqa: E402
from bench_e2e import parse_ops  # noqa: E402
from sp_models import MODELS, model_values  # noqa: E402

GIB = 2**30
DEFAULT_SP_LENGTHS = "4:32768,65536,131072;1:32768,65536,131072"
SYNTHETIC = "(synthetic: random token ids, nothing is read)"  # the recipe's data/tokenizer are never opened

# ---------------------------------------------------------------- setup


def make_recipe(args: argparse.Namespace, sp: int, max_len: int, world: int) -> rc.Recipe:
    """The recipe of one SP degree as the trainer reads it. ``train_step`` reads ``recipe.optim``; the data and
    tokenizer entries are placeholders (the data is synthetic)."""
    return rc.Recipe(
        model=rc.ModelSection(config=model_values(args), weights=None, tokenizer=SYNTHETIC,
                              dtype="bfloat16" if args.precision == "bf16" else "float32"),
        data=rc.DataSection(train_files=(SYNTHETIC,), max_seq_len=max_len, num_workers=0),
        parallel=rc.ParallelSection(sp=sp, activation_checkpointing=args.ac,
                                    reshard_after_forward=not args.no_reshard,
                                    async_ulysses=args.async_ulysses and sp > 1),
        ops=rc.OpsSection(**args.ops),
        optim=rc.OptimSection(lr=args.lr, weight_decay=args.weight_decay, schedule="constant",
                              max_grad_norm=args.max_grad_norm),
        train=rc.TrainSection(tokens_per_step=max_len * (world // sp), tokens_per_micro_batch=max_len, steps=1,
                              seed=args.seed, device=args.device),
    )  # fmt: skip


def default_ops(requested: dict[str, str]) -> tuple[dict[str, str], str]:
    """``requested`` and why its attention backend runs (for the JSON)."""
    if "attention" in requested:
        return requested, "given with --ops"
    # One document per SP group: the attention backend sees a single segment and runs SDPA unmasked (cuDNN/flash on
    # CUDA). Measured on 4 x H200 at 128k: 37.8% MFU against 25.1% with attention=varlen (notebook/benchmarks-log.md).
    return requested, "OpsConfig default (one segment, so unmasked SDPA)"


def _hardware(device: torch.device) -> Hardware:
    # Kernels are validated against the device we run on (--device cpu on a GPU machine: CPU kernels).
    hardware = detect_hardware()
    if hardware.device_type != device.type:
        hardware = Hardware(device_type=device.type, triton_interpret=hardware.triton_interpret)
    return hardware


def build(recipe: rc.Recipe, device: torch.device) -> tuple[loop.Run, dict[str, Any]]:
    """Model, AdamW and a constant schedule as `veomni.train.loop.build_run` makes them on several ranks."""
    torch.manual_seed(recipe.train.seed)  # the same initial weights for every SP degree
    state = build_parallel_state(loop.parallel_dims(recipe, dist.get_world_size()), device.type)
    config = loop.model_config(recipe)
    ops = recipe.ops.to_ops_config(hardware=_hardware(device))
    probe = loop.meta_instance(config)
    model = loop.build_recipe_model(recipe, config, probe, ops, state, device)  # build_run's own call
    model.train()
    o = recipe.optim
    # One bf16 rank takes the master-weights path: AdamW steps the fp32 masters, as build_run builds it.
    masters = master_weights_of(model)
    trained = model if masters is None else masters.module
    optimizer = build_adamw(trained, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = build_scheduler(optimizer, Schedule(kind="constant", warmup_steps=0, total_steps=1))
    # train_step uses model, optimizer, scheduler, state, device and recipe.optim; the data, tokenizer and
    # checkpoint slots of a Run are not needed for synthetic steps.
    run = loop.Run(
        recipe=recipe, state=state, device=device, tokenizer=None, model=model, optimizer=optimizer,
        scheduler=scheduler, train_data=None, eval_data=None, checkpoints=None, total_steps=0,
        task=TextTask.for_model(probe), config=probe.config, masters=masters,
    )  # fmt: skip
    info = {
        "training_path": loop.one_rank_path(recipe, dist.get_world_size()),  # fsdp2, plain or master_weights
        "ops": {name: getattr(ops, name) for name in ("attention", "cross_entropy", "rms_norm", "rope", "swiglu",
                                                       "gated_delta_rule", "causal_conv1d")},
        "attn_implementation": model.config._attn_implementation,
        # Whether build_recipe_model compiled the blocks (async_ulysses keeps them eager) and the exchange mode.
        "compiled_blocks": compile_stats(model) is not None,
        "async_ulysses": recipe.parallel.async_ulysses,
        "fsdp": {"mesh": "dp_shard*sp (all ranks)", "compute_dtype": recipe.model.dtype, "param_dtype":
                 recipe.model.param_dtype, "reduce_dtype": "float32",
                 "reshard_after_forward": recipe.parallel.reshard_after_forward},
        "flops_per_token_matmul": run.task.flops_per_token,
        "query_width": loop.query_width(probe.config),
        "attention_layers": attention_layers(probe.config),  # softmax-attention layers (quadratic FLOPs term)
    }  # fmt: skip
    return run, info


# ---------------------------------------------------------------- data


def document(seed: int, step: int, dp_rank: int, seq_len: int, vocab: int) -> Sample:
    """One document of ``seq_len`` random ids (int64), seeded by (seed, step, dp rank); every token but the
    first is a prediction target."""
    ids = np.random.default_rng([seed, step, dp_rank]).integers(0, vocab, size=seq_len, dtype=np.int64)
    trained = np.ones(seq_len, dtype=bool)
    trained[0] = False
    return Sample(input_ids=ids, trained=trained, index=dp_rank)


def synthetic_steps(
    count: int, seq_len: int, vocab: int, state: ParallelState, seed: int, same_data: bool
) -> list[Step]:
    """``count`` one-micro-batch `Step`s for this rank: its SP slice of its dp rank's document (trainer layout)."""
    dp, sp = state.dims.dp, state.dims.sp
    steps = []
    for i in range(count):
        sample = document(seed, i, 0 if same_data else state.dp_rank, seq_len, vocab)
        batch = collate([sample], sp_rank=state.sp_rank, sp_size=sp)
        steps.append(Step(step=i, epoch=0, micro_batches=[batch], tokens=seq_len * dp,
                          valid_tokens=(seq_len - 1) * dp))  # fmt: skip
    return steps


def tap_losses(model: torch.nn.Module) -> list[torch.Tensor]:
    """A list that receives every loss the model returns (this rank's token-loss sum / N_global), through a
    forward hook on the root, so that `train_step` runs unchanged. Activation checkpointing recomputes blocks,
    never the root, so the hook fires once per micro-batch."""
    seen: list[torch.Tensor] = []
    model.register_forward_hook(lambda module, args, output: seen.append(output.loss.detach()))
    return seen


def seq0_loss(seen: list[torch.Tensor], step: Step, state: ParallelState) -> float:
    """Token-mean loss over dp rank 0's document: the sum over its SP group of (loss * N_global) / its count."""
    part = torch.zeros(2, dtype=torch.float64, device=state.device)
    if state.dp_rank == 0:
        part[0] = seen[-1].double() * step.valid_tokens
        part[1] = float(step.micro_batches[0]["num_valid_tokens"])
    dist.all_reduce(part)
    return float(part[0] / part[1])


# ---------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(
    run: loop.Run,
    info: dict[str, Any],
    seen: list[torch.Tensor],
    seq_len: int,
    args: argparse.Namespace,
    label: str,
) -> dict[str, Any]:
    """Warm-up then timed `train_step`s at ``seq_len``; returns the configuration's JSON record."""
    device, state = run.device, run.state
    vocab = run.model.config.vocab_size
    n = args.warmup + args.steps
    steps = synthetic_steps(n, seq_len, vocab, state, args.seed, args.same_data)
    _free(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    losses, seq0, norms, seconds = [], [], [], []
    for step in steps:
        _sync(device)
        t0 = time.perf_counter()
        stats = loop.train_step(run, step)  # ends with a host read of the all-reduced loss
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        seq0.append(seq0_loss(seen, step, state))
        seen.clear()
        _say(f"{label} step {step.step + 1}/{n}: {seconds[-1]:.3f} s, loss {losses[-1]:.5f}, "
             f"grad norm {norms[-1]:.4f}")  # fmt: skip
    seconds = max_over_ranks(seconds, device)  # a step ends when its slowest rank does
    timed = seconds[args.warmup :]
    tokens = steps[0].tokens
    lengths = [seq_len] * state.dims.dp
    flops = (
        run.task.flops_per_token * tokens
        + attention_flops(lengths, info["attention_layers"], info["query_width"])
        + attention_flops(lengths, run.task.window_layers, info["query_width"], window=run.task.window)
    )
    world, peak = state.dims.world_size, peak_flops(device)
    record: dict[str, Any] = {
        "tokens_per_step": tokens, "losses": losses, "seq0_losses": seq0, "grad_norms": norms, "step_s": timed,
        "warmup_step_s": seconds[: args.warmup], "median_step_s": statistics.median(timed),
        "tokens_per_s_per_gpu": tokens * len(timed) / sum(timed) / world, "flops_per_step": flops,
        "mfu": flops * len(timed) / sum(timed) / world / peak if peak else None,
    }  # fmt: skip
    if device.type == "cuda":
        mem = max_over_ranks(
            [before, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)], device
        )
        record |= {"memory_before_gib": mem[0] / GIB, "peak_allocated_gib": mem[1] / GIB,
                   "peak_reserved_gib": mem[2] / GIB}  # fmt: skip
    return record


def sp_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """SP=P over SP=1 at every length where both ran: tokens/s per GPU and memory (ratios of the records)."""
    ok = {(r["sp"], r["seq_len"]): r for r in runs.values() if "error" not in r}
    out = {}
    for (sp, seq_len), r in sorted(ok.items()):
        base = ok.get((1, seq_len))
        if sp == 1 or base is None:
            continue
        ratio: dict[str, Any] = {"sp": sp, "seq_len": seq_len}
        for key in ("tokens_per_s_per_gpu", "peak_allocated_gib", "peak_reserved_gib"):
            if key in r and key in base:
                ratio[key] = r[key] / base[key]
        out[f"sp{sp}/sp1@{seq_len}"] = ratio
    return out


# ---------------------------------------------------------------- CLI and main


def parse_sp_lengths(text: str) -> list[tuple[int, list[int]]]:
    """``"4:32768,65536;1:32768"`` -> ``[(4, [32768, 65536]), (1, [32768])]`` (order kept)."""
    plan = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        match = re.fullmatch(r"(\d+):(\d+(?:,\d+)*)", part.replace(" ", ""))
        if not match or int(match[1]) < 1 or min(int(x) for x in match[2].split(",")) < 2:
            raise ValueError(f"--sp-lengths: expected 'sp:len,len;sp:len,...' with sp >= 1 and lengths >= 2, "
                             f"got {part!r} in {text!r}")  # fmt: skip
        plan.append((int(match[1]), [int(x) for x in match[2].split(",")]))
    if not plan:
        raise ValueError(f"--sp-lengths is empty: {text!r}")
    return plan


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True, help="where to write the JSON results (rewritten after every configuration)")
    add("--sp-lengths", default=DEFAULT_SP_LENGTHS, help="'sp:len,len;sp:len,...' run in this order")
    add("--steps", type=int, default=3, help="timed optimizer steps per configuration")
    add("--warmup", type=int, default=1, help="untimed optimizer steps first")
    add("--model", choices=sorted(MODELS), default="qwen3_8b", help="the architecture (published shapes)")
    add("--tiny", action="store_true", help="a toy of --model's architecture (CPU smoke)")
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16: bf16 compute over fp32 masters, fp32 reduce; fp32: no mixed precision (parity)")  # fmt: skip
    add("--ops", default="", help="OpsConfig overrides, e.g. attention=flash_attn_3,rope=eager")
    add("--no-ac", dest="ac", action="store_false", help="turn activation checkpointing off")
    add("--no-reshard", action="store_true", help="FSDP2 reshard_after_forward=False")
    add(
        "--async-ulysses",
        action="store_true",
        help="parallel.async_ulysses on the SP > 1 configurations (projections overlap the exchange)",
    )
    add("--same-data", action="store_true", help="every dp rank trains dp rank 0's document (parity check)")
    add("--seed", type=int, default=0, help="initial weights and data")
    add("--lr", type=float, default=1e-5)
    add("--weight-decay", type=float, default=0.1)
    add("--max-grad-norm", type=float, default=1.0)
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--append", action="store_true",
        help="keep the runs already in --out (an earlier command's) and add these: split a long job in parts")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.plan = parse_sp_lengths(args.sp_lengths)
        args.ops = parse_ops(args.ops)
    except ValueError as err:
        p.error(str(err))
    if args.steps < 1 or args.warmup < 0:
        p.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(f"[bench_sp] {line}", flush=True)


def _write(result: dict[str, Any], path: str) -> None:
    if dist.get_rank() != 0:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, path)  # a run killed mid-write still leaves the previous complete file


def _errors(error: str | None) -> list[str]:
    """Every rank's error of this configuration (all ranks must call it)."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return [f"rank {i}: {e}" for i, e in enumerate(gathered) if e is not None]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every configuration, write ``--out`` and print a table on rank 0; returns the JSON object."""
    args = parse_args(argv)
    created_group = not dist.is_initialized()
    device = loop.setup_distributed(args.device)
    try:
        return _run(args, device)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _header(args: argparse.Namespace, device: torch.device, why: str) -> dict[str, Any]:
    return {
        "benchmark": "bench_sp (T5: Ulysses SP, long context)",
        "command": sys.orig_argv, "argv": sys.argv,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "model": {"name": ("tiny " if args.tiny else "") + MODELS[args.model][2],
                  "weights": f"random init (the model's _init_weights, torch.manual_seed({args.seed}))",
                  "config": model_values(args)},
        "settings": {"precision": args.precision, "activation_checkpointing": args.ac,
                     "reshard_after_forward": not args.no_reshard, "steps": args.steps, "warmup": args.warmup,
                     "same_data": args.same_data, "lr": args.lr, "max_grad_norm": args.max_grad_norm,
                     "attention_choice": why, "step": "veomni.train.loop.train_step (one micro-batch per dp rank)"},
        "mfu_convention": "6*matmul_params*tokens + 6*L*Hq*D*sum(seq_len^2) over step time, world and peak "
                          "(veomni.train.metrics; recomputation not counted)",
        "runs": {}, "ratios": {},
    }  # fmt: skip


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    world = dist.get_world_size()
    if bad := [sp for sp, _ in args.plan if world % sp]:
        raise SystemExit(f"--sp-lengths: SP degrees {bad} do not divide the world size {world}")
    args.ops, why = default_ops(args.ops)
    result = _header(args, device, why)
    if args.append and os.path.exists(args.out):  # one host: every rank reads the same file
        with open(args.out) as f:
            earlier = json.load(f)
        result["runs"] = earlier["runs"]
        result["earlier_commands"] = earlier.get("earlier_commands", []) + [earlier["command"]]
    runs = result["runs"]
    for sp, lengths in args.plan:
        run, info, seen, oom_at, done_steps = None, {}, [], None, 0
        for seq_len in lengths:
            key = f"sp{sp}_seq{seq_len}"
            record: dict[str, Any] = {"sp": sp, "dp": world // sp, "seq_len": seq_len}
            if oom_at is not None and seq_len >= oom_at:
                runs[key] = record | {"error": f"skipped: sp={sp} ran out of memory at seq_len={oom_at}"}
                _write(result, args.out)
                continue
            _say(f"{key}: start")
            error = None
            try:
                if run is None:
                    t0 = time.perf_counter()
                    recipe = make_recipe(args, sp, max(lengths), world)
                    run, info = build(recipe, device)
                    seen, done_steps = tap_losses(run.model), 0
                    record["build_s"] = time.perf_counter() - t0
                record |= info | {"model_steps_before": done_steps}
                record |= measure(run, info, seen, seq_len, args, key)
                done_steps += args.warmup + args.steps
            except Exception as err:  # noqa: BLE001 -- one failed configuration must not end the benchmark
                error = f"{type(err).__name__}: {err}"[:2000]
                traceback.print_exc()
            errors = _errors(error)
            if errors:
                record = {k: record[k] for k in ("sp", "dp", "seq_len")} | {"error": "; ".join(errors)}
                if any("out of memory" in e.lower() for e in errors):
                    oom_at = seq_len
                run = None  # a failed step may leave FSDP mid-flight: rebuild for the next length
            runs[key] = record
            _free(device)
            result["ratios"] = sp_ratios(runs)
            _write(result, args.out)
            _say(_row(key, record))
        run = None
        _free(device)
    fits = [r["seq_len"] for r in runs.values() if r["sp"] == 1 and "error" not in r]
    result["longest_sp1_fit"] = max(fits) if fits else None
    result["at_longest_sp1_fit"] = {
        k: v for k, v in result["ratios"].items() if v["seq_len"] == max(fits, default=-1)
    }
    _write(result, args.out)
    if dist.get_rank() == 0:
        _print_table(result)
    return result


HEADER = f"{'config':16s} {'tok/s/GPU':>11s} {'MFU':>7s} {'alloc GiB':>9s} {'resv GiB':>9s} {'step s':>8s} "
HEADER += f"{'loss[0]':>9s} {'seq0[0]':>9s}"


def _row(key: str, r: dict[str, Any]) -> str:
    """One table row (``HEADER``'s columns) of a configuration's record."""
    if "error" in r:
        return f"{key:16s} ERROR {r['error'][:150]}"
    mfu = f"{r['mfu'] * 100:6.1f}%" if r["mfu"] is not None else "    n/a"
    alloc = f"{r['peak_allocated_gib']:9.2f}" if "peak_allocated_gib" in r else "      n/a"
    resv = f"{r['peak_reserved_gib']:9.2f}" if "peak_reserved_gib" in r else "      n/a"
    return (f"{key:16s} {r['tokens_per_s_per_gpu']:11,.0f} {mfu} {alloc} {resv} {r['median_step_s']:8.3f} "
            f"{r['losses'][0]:9.5f} {r['seq0_losses'][0]:9.5f}")  # fmt: skip


def _print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['device']} x{result['world_size']}, torch {result['torch']}, {result['model']['name']}")
    print(HEADER)
    for key, r in result["runs"].items():
        print(_row(key, r))
    for pair, ratio in result["ratios"].items():
        parts = [f"{k.removesuffix('_gib')} x{v:.3f}" for k, v in ratio.items() if k not in ("sp", "seq_len")]
        print(f"{pair}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
