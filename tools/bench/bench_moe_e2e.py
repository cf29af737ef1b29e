"""T6: Qwen3-30B-A3B-class MoE training steps on several GPUs, veomni (EP + FSDP2) against plain HF transformers.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 tools/bench/bench_moe_e2e.py --out moe.json
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench/bench_moe_e2e.py --out s.json \\
        --tiny --device cpu --precision fp32 --tokens 256 --steps 2 --warmup 1          # CPU smoke (gloo, EP=2)

Model: Qwen3-30B-A3B's published config, inline, depth cut to ``--layers`` (default 16 of 48). Parameters: 0.62B
(embedding + LM head) + 0.623B per layer (0.604B of it the 128 experts): 10.6B at 16 layers, 1.22B active per
token. At 16 bytes per parameter (fp32 master, gradient and two AdamW moments) that is 170 GB of state, 42.5 GB
per GPU over 4; an 8192-token micro-batch adds ~20 GB of activations and ~15 GB of fp32 logits and their
gradient: both contenders fit an H200 (141 GB) with room to spare (24 layers would be ~105 GB for HF).

Same start and data for both: rank 0 initialises the model with plain transformers (seeded, in the compute
dtype) and ``save_pretrained``s it to a temporary directory; both load it into fp32 masters. Each rank trains
its own packed micro-batch of ``--tokens`` tokens per step (`bench_e2e.packed_batches`: documents of seeded
random lengths, positions restarting and labels shifted per document); ranks differ, contenders do not.

- ``veomni`` (runs first, so that an HF OOM cannot cost its result): model and optimizer built as
  ``veomni.train.loop.build_run`` builds them (its ``build_recipe_model``: ``ParallelDims.for_world(world, ep)``,
  ``OpsConfig`` defaults -- Triton kernels and EP dispatch on CUDA --, bf16 compute over fp32 masters, fp32
  reduce; ``build_adamw``; the aux coefficient taken off the model), and every step is the trainer's own
  ``train_step`` fed synthetic ``Step``s (global token-mean loss, aux weighted ``coef / dp``, veomni's clip).
- ``hf``: ``AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa")`` with HF's default experts
  implementation (recorded), ``fully_shard`` per decoder layer + root with ``MixedPrecisionPolicy(bf16, reduce
  fp32)``, fused ``torch.optim.AdamW`` (same groups), ``clip_grad_norm_``; HF's labels path with
  ``output_router_logits=True`` (loss = LM + coef * aux, as HF adds it), scaled as HF's Trainer does with
  ``average_tokens_across_devices``: global ``num_items_in_batch``, loss * world before backward. No EP.

Per contender: tokens/s per GPU, MFU (``veomni.train.metrics``' causal convention, routed experts counted
top_k/E), peak allocated memory per GPU during the steps (max over ranks), step times (slowest rank), per-step
LM loss (global token mean, aux excluded on both sides) and grad norm. The JSON is rewritten after each
contender; a contender that raises on every rank (CUDA OOM, say) becomes ``{"error": ...}``. A failure on only
some ranks can leave the others in a collective until the process-group timeout (the JSON keeps what finished).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from veomni.core.master_weights import master_weights_of
from veomni.core.parallel_state import build_parallel_state
from veomni.kernels import Hardware, detect_hardware
from veomni.train import loop
from veomni.train.data import Step
from veomni.train.metrics import active_matmul_params, attention_flops, peak_flops
from veomni.train.optim import Schedule, build_adamw, build_scheduler, param_groups
from veomni.train.recipe import Recipe, recipe_from_dict
from veomni.train.tasks.text import TextTask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_e2e lives beside this script
from bench_common import profile_calls  # noqa: E402
from bench_e2e import _free, _sync, packed_batches, parse_ops  # noqa: E402

# Run order: veomni first, so that an HF OOM cannot cost its result. veomni_head_in_root: the same with the LM head
# left in the root FSDP unit (parallel.lm_head_unit: false), the layout before the head became a unit of its own.
CONTENDERS = ("veomni", "veomni_head_in_root", "hf")
GIB = 2**30
BETAS, EPS = (0.9, 0.95), 1e-8

# Qwen3-30B-A3B's published config.json (depth set by --layers), written out so that nothing is downloaded.
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "max_position_embeddings": 40_960, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "initializer_range": 0.02, "bos_token_id": 151_643, "eos_token_id": 151_645,
}  # fmt: skip
# The same architecture shrunk for CPU smoke runs (uneven sizes so that nothing lines up by accident).
TINY: dict[str, Any] = QWEN3_30B_A3B | {
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 24,
    "num_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip


def moe_config(tiny: bool, layers: int | None) -> PretrainedConfig:
    """The benchmark's Qwen3-MoE config: published (or tiny) values, ``layers`` decoder layers, no KV cache."""
    values = dict(TINY if tiny else QWEN3_30B_A3B)
    if layers is not None:
        values["num_hidden_layers"] = layers
    return AutoConfig.for_model(values.pop("model_type"), **values, use_cache=False)


def save_initial_weights(config: PretrainedConfig, path: str, seed: int, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
    """Seeded plain-HF init of ``config`` in ``dtype`` on ``device`` (fast on a GPU), ``save_pretrained`` to ``path``."""
    torch.manual_seed(seed)
    with torch.device(device):
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    _free(device)


# ---------------------------------------------------------------- contenders


class Veomni:
    """``build_run``'s model and optimizer (no tokenizer, data or checkpoints); steps are ``train_step``."""

    head_unit = True

    def __init__(self, args: argparse.Namespace, weights: str, device: torch.device) -> None:
        recipe = _recipe(args, weights, head_unit=self.head_unit)
        world = dist.get_world_size()
        state = build_parallel_state(loop.parallel_dims(recipe, world), device.type)
        config = recipe.model.weights  # the saved config.json, as model_config() gives for config: null
        probe = loop.meta_instance(config)
        hw = detect_hardware()  # kernels are validated against the device we run on, as build_run does
        if hw.device_type != device.type:
            hw = Hardware(device_type=device.type, triton_interpret=hw.triton_interpret)
        ops = recipe.ops.to_ops_config(hardware=hw)
        model = loop.build_recipe_model(recipe, config, probe, ops, state, device)  # build_run's own call
        task = TextTask.for_model(probe)
        aux_coef = task.aux_loss_coef
        loop.hand_aux_loss_to_loop(model)  # as build_run: the loop adds the aux term itself, per micro-batch
        # One bf16 rank takes the master-weights path: AdamW steps the fp32 masters, as build_run builds it.
        masters = master_weights_of(model)
        optimizer = build_adamw(
            model if masters is None else masters.module, lr=recipe.optim.lr, betas=tuple(recipe.optim.betas),
            eps=recipe.optim.eps, weight_decay=recipe.optim.weight_decay,
        )  # fmt: skip
        n = args.warmup + args.steps
        scheduler = build_scheduler(optimizer, Schedule(kind="constant", warmup_steps=0, total_steps=n))
        self.run = loop.Run(
            recipe=recipe, state=state, device=device, tokenizer=None, model=model, optimizer=optimizer,
            scheduler=scheduler, train_data=None, eval_data=None, checkpoints=None, total_steps=n,
            task=task, config=probe.config, masters=masters,
        )  # fmt: skip
        self.tokens_per_step = args.tokens * state.dims.dp
        self.info = {
            "parallel": {"dp_shard": state.dims.dp_shard, "ep": state.dims.ep, "ep_fsdp": state.dims.ep_fsdp},
            "ops": {f: getattr(ops, f) for f in ("attention", "cross_entropy", "rms_norm", "rope", "swiglu",
                                                 "moe_experts", "load_balancing_loss")},
            "experts_implementation": f"{model.config._experts_implementation} (moe_experts={ops.moe_experts}, "
                                      f"{'grouped kernel behind EP dispatch/combine' if state.ep_enabled else 'routed kernel'})",
            "attn_implementation": model.config._attn_implementation,
            "precision": (
                f"FSDP2 (+EP) with {recipe.model.dtype} compute, fp32 masters, fp32 reduce"
                if loop.one_rank_path(recipe, world) == "fsdp2"
                else f"one rank, no FSDP2: {recipe.model.dtype} parameters"
                + (" over fp32 master weights the optimizer steps" if masters is not None else "")
            ),
            "optimizer": "veomni.train.optim.build_adamw (torch AdamW, fused), constant lr",
            "step": "veomni.train.loop.train_step (aux loss weighted router_aux_loss_coef / dp)",
            "router_aux_loss_coef": aux_coef,
            "activation_checkpointing": recipe.parallel.activation_checkpointing,
            "lm_head_unit": recipe.parallel.lm_head_unit,
        }  # fmt: skip

    def step(self, index: int, batch: dict[str, Any], valid_tokens: int) -> dict[str, float]:
        """One optimizer step on this rank's ``batch`` (a `packed_batches` dict on the device: ``input_ids``,
        ``position_ids``, ``labels`` int64 ``[1, S]``, ``cu_seqlens`` int32); ``valid_tokens``: the step's valid
        labels over all ranks. Returns the global LM token-mean loss and the grad norm before clipping."""
        step = Step(
            step=index, epoch=0, micro_batches=[batch], tokens=self.tokens_per_step, valid_tokens=valid_tokens
        )
        stats = loop.train_step(self.run, step)
        return {"loss": stats["loss"], "grad_norm": stats["grad_norm"]}


class HF:
    """Plain transformers v5 made data-parallel the plain-PyTorch way: FSDP2 per decoder layer + root."""

    def __init__(self, args: argparse.Namespace, weights: str, device: torch.device) -> None:
        self.device, self.world, self.max_norm = device, dist.get_world_size(), args.max_grad_norm
        # Loading straight onto this rank's GPU is fast; fully_shard then keeps only this rank's shards.
        where = {"device_map": device} if device.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(weights, attn_implementation="sdpa", dtype=torch.float32, **where)  # fmt: skip
        model.train()
        if args.ac == "all":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mesh = init_device_mesh(device.type, (self.world,))
        compute = torch.bfloat16 if args.precision == "bf16" else None
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        groups = [{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, args.weight_decay)]  # fmt: skip
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=BETAS, eps=EPS, fused=True)
        self.model = model
        self.coef = float(model.router_aux_loss_coef)
        self.info = {
            "experts_implementation": model.config._experts_implementation,
            "attn_implementation": model.config._attn_implementation,
            "precision": f"fully_shard per decoder layer + root, MixedPrecisionPolicy(param_dtype={compute}, "
                         "reduce_dtype=float32), fp32 masters",
            "optimizer": "torch.optim.AdamW(fused=True), same param groups and hyper-parameters, constant lr",
            "step": "HF labels path + output_router_logits (loss = lm + coef * aux); num_items_in_batch over all "
                    "ranks and loss * world before backward (HF Trainer, average_tokens_across_devices)",
            "router_aux_loss_coef": self.coef,
            "activation_checkpointing": args.ac == "all",
        }  # fmt: skip

    def step(self, index: int, batch: dict[str, Any], valid_tokens: int) -> dict[str, float]:
        """As `Veomni.step`, plus ``aux_loss``: HF's load-balancing loss, averaged over the ranks."""
        num_items = torch.tensor(
            valid_tokens, device=self.device, dtype=torch.int64
        )  # as the trainer passes it
        out = self.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
            shift_labels=batch["labels"], num_items_in_batch=num_items, output_router_logits=True,
            use_cache=False,
        )  # fmt: skip
        (out.loss * self.world).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        aux = out.aux_loss.detach().float()
        # This rank's LM share (its label-loss sum over the global count); summed over ranks: the token mean.
        sums = torch.stack([out.loss.detach().float() - self.coef * aux, aux])
        dist.all_reduce(sums)
        return {"loss": float(sums[0]), "grad_norm": float(norm), "aux_loss": float(sums[1]) / self.world}


class VeomniHeadInRoot(Veomni):
    """`Veomni` with ``parallel.lm_head_unit: false``: the LM head gathered and reduced with the root unit."""

    head_unit = False


BUILDERS = {"veomni": Veomni, "veomni_head_in_root": VeomniHeadInRoot, "hf": HF}


def _recipe(args: argparse.Namespace, weights: str, head_unit: bool = True) -> Recipe:
    """A trainer recipe holding this run's settings (data and checkpoint fields are required but unused)."""
    ops = dict(args.veomni_ops)
    if args.device_type == "cpu":
        # The eager expert loop cannot run on EP shards; torch._grouped_mm has CPU kernels.
        ops.setdefault("moe_experts", "torch")
    world = dist.get_world_size()
    return recipe_from_dict({
        "model": {"config": None, "weights": weights, "dtype": "bfloat16" if args.precision == "bf16" else "float32"},
        "data": {"train_files": ["builtin://quickstart/train.jsonl"], "max_seq_len": args.tokens, "num_workers": 0},
        "parallel": {"ep": args.ep, "activation_checkpointing": args.ac in ("veomni", "all"),
                     "lm_head_unit": head_unit},
        "ops": ops,
        "optim": {"lr": args.lr, "betas": list(BETAS), "eps": EPS, "weight_decay": args.weight_decay,
                  "schedule": "constant", "warmup_steps": 0, "max_grad_norm": args.max_grad_norm},
        "train": {"tokens_per_step": args.tokens * world, "tokens_per_micro_batch": args.tokens,
                  "steps": args.warmup + args.steps, "device": args.device_type},
        "checkpoint": {"dir": os.path.join(weights, "unused_run_dir"), "resume": "never", "hf_export": False,
                       "save_final": False},
    })  # fmt: skip


# ---------------------------------------------------------------- running


def run_contender(name: str, args: argparse.Namespace, weights: str, device: torch.device,
                  steps: list[tuple[dict[str, Any], int]], flops: list[float]) -> dict[str, Any]:  # fmt: skip
    """Build ``name``, run ``steps`` (this rank's batch, global valid labels), free it; return its record."""
    rank0, world = dist.get_rank() == 0, dist.get_world_size()
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    contender = BUILDERS[name](args, weights, device)
    build_s = time.perf_counter() - t0
    build_peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the steps' peak, not the loading's
    losses, norms, aux, seconds = [], [], [], []
    for i, (batch, valid) in enumerate(steps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        stats = contender.step(i, batch, valid)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        if "aux_loss" in stats:
            aux.append(stats["aux_loss"])
        if rank0:
            tag = "warm-up" if i < args.warmup else "timed"
            print(f"[bench_moe] {name} step {i + 1}/{len(steps)} ({tag}) {seconds[-1] * 1e3:9.1f} ms  "
                  f"loss {losses[-1]:.5f}  grad norm {norms[-1]:.4f}", flush=True)  # fmt: skip
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    if args.profile:
        _profile(name, contender, steps[-2:], args.profile, device)
    record: dict[str, Any] = dict(contender.info)
    del contender  # the model and optimizer go with it
    _free(device)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"peak": peak, "build_peak": build_peak, "step_s": seconds})
    # A step ends when its slowest rank does.
    timed = [max(r["step_s"][i] for r in per_rank) for i in range(args.warmup, len(steps))]
    device_peak = peak_flops(device)
    record |= {
        "build_s": build_s, "losses": losses, "grad_norms": norms, "final_loss": losses[-1], "step_s": timed,
        "step_s_per_rank": [r["step_s"] for r in per_rank], "median_step_ms": statistics.median(timed) * 1e3,
        "tokens_per_s_per_gpu": args.tokens * len(timed) / sum(timed),
        "mfu": sum(flops[args.warmup :]) / (sum(timed) * world * device_peak) if device_peak else None,
    }  # fmt: skip
    if aux:
        record["aux_losses_rank_mean"] = aux
    if device.type == "cuda":
        record |= {"peak_memory_gib": max(r["peak"] for r in per_rank),
                   "peak_memory_gib_per_rank": [r["peak"] for r in per_rank],
                   "build_peak_memory_gib": max(r["build_peak"] for r in per_rank)}  # fmt: skip
    return record


def _profile(name: str, contender: Any, steps: list[tuple[dict[str, Any], int]], out_dir: str,
             device: torch.device) -> None:  # fmt: skip
    """Two more steps on every rank under torch.profiler (after timing); rank 0 writes the top ops by device time
    to ``<out_dir>/<name>.txt``."""

    def run() -> None:
        for i, (batch, valid) in enumerate(steps):
            contender.step(i, batch, valid)

    out = os.path.join(out_dir, f"{name}.txt") if dist.get_rank() == 0 else None
    profile_calls(run, device, out, steps=len(steps), rows=45)


def _agree(record: dict[str, Any]) -> dict[str, Any]:
    """Every rank's outcome to every rank: one failed rank makes the contender an error everywhere."""
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, record.get("error"))
    errors = {rank: e for rank, e in enumerate(outcomes) if e is not None}
    if not errors:
        return record
    return {"error": next(iter(errors.values())), "errors_by_rank": errors}


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, path)  # a reader (or a timeout) never sees half a file


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True, help="where rank 0 writes the JSON results")
    add("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    add("--tiny", action="store_true", help="a 2-layer toy Qwen3-MoE (CPU smoke)")
    add("--layers", type=int, default=None, help="decoder layers (default 16 of 48; tiny: 2)")
    add("--ep", type=int, default=None, help="veomni's expert-parallel degree (default: the world size)")
    add("--tokens", type=int, default=8192, help="tokens per rank per step (one packed micro-batch)")
    add("--warmup", type=int, default=2, help="untimed optimizer steps first")
    add("--steps", type=int, default=5, help="timed optimizer steps")
    add("--seed", type=int, default=0, help="weights use seed, data seed + 1")
    add("--lr", type=float, default=1e-5)
    add("--weight-decay", type=float, default=0.1)
    add("--max-grad-norm", type=float, default=1.0)
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16: bf16 compute over fp32 masters for both; fp32: fp32 throughout (parity, not a benchmark)")  # fmt: skip
    add("--ac", choices=("none", "veomni", "all"), default="none",
        help="activation checkpointing for veomni only, or for both")  # fmt: skip
    add("--veomni-ops", default="", help="OpsConfig overrides, e.g. moe_experts=torch,attention=varlen")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--profile", default=None, help="directory for a torch.profiler table of 2 extra steps per contender")
    add("--tmpdir", default=None, help="local-disk directory for the initial weights (default: system temp)")
    args = p.parse_args(argv)
    args.contenders = [c for c in filter(None, args.contenders.split(","))]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown or not args.contenders:
        p.error(f"--contenders: unknown {unknown} (choose from {CONTENDERS})" if unknown else "--contenders is empty")  # fmt: skip
    args.layers = args.layers if args.layers is not None else (None if args.tiny else 16)
    if args.layers is not None and not 1 <= args.layers <= 48:
        p.error(f"--layers must be in 1..48 (Qwen3-30B-A3B has 48), got {args.layers}")
    if args.tokens < 16 or args.steps < 1 or args.warmup < 0:
        p.error(f"need --tokens >= 16, --steps >= 1, --warmup >= 0; got {args.tokens}, {args.steps}, {args.warmup}")  # fmt: skip
    try:
        args.veomni_ops = parse_ops(args.veomni_ops)
    except ValueError as err:
        p.error(f"--veomni-ops: {err}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the benchmark on every rank; rank 0 writes ``--out``, prints a table and returns the JSON object."""
    args = parse_args(argv)
    device = loop.setup_distributed(args.device)
    args.device_type = device.type
    args.ep = args.ep or dist.get_world_size()
    weights = None
    try:
        if dist.get_rank() == 0:
            weights = tempfile.mkdtemp(prefix="bench_moe_", dir=args.tmpdir)
        box = [weights]
        dist.broadcast_object_list(box, src=0)
        return _run(args, device, box[0])
    finally:
        if dist.is_initialized():
            dist.barrier()
            if weights is not None:
                shutil.rmtree(weights, ignore_errors=True)
            dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device, weights: str) -> dict[str, Any] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rank0 = rank == 0
    config = moe_config(args.tiny, args.layers)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    total_params = sum(p.numel() for p in probe.parameters())
    experts = [n for n, _ in probe.named_parameters() if ".experts." in n]
    n_active = active_matmul_params(probe, experts, config.num_experts_per_tok / config.num_experts)
    del probe
    n_steps = args.warmup + args.steps
    # Every rank draws every rank's batches (cheap), so the global label count needs no communication.
    # Documents of tokens/16 .. tokens/2 tokens, as bench_e2e.
    cpu = packed_batches(n_steps * world, args.tokens, config.vocab_size, args.tokens // 16, args.tokens // 2, args.seed + 1)  # fmt: skip
    per_step = [cpu[i * world : (i + 1) * world] for i in range(n_steps)]
    valid = [sum(b["num_valid"] for b in step) for step in per_step]
    steps = [({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in s[rank].items()}, n)
             for s, n in zip(per_step, valid, strict=True)]  # fmt: skip
    q_width = config.num_attention_heads * config.head_dim
    flops = [sum(6.0 * n_active * b["input_ids"].numel()
                 + attention_flops(b["doc_lens"], config.num_hidden_layers, q_width) for b in step)
             for step in per_step]  # fmt: skip
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "world_size": world,
        "command": " ".join([sys.executable, "-m torch.distributed.run", *sys.argv]),
        "versions": _versions(),
        "model": f"Qwen3-30B-A3B-class MoE, {config.num_hidden_layers} of 48 layers" if not args.tiny
                 else "tiny Qwen3-MoE (smoke)",
        "layers": config.num_hidden_layers,
        "config": {k: v for k, v in (TINY if args.tiny else QWEN3_30B_A3B).items()}
                  | {"num_hidden_layers": config.num_hidden_layers},
        "params": {"total": total_params, "active_matmul": n_active,
                   "training_state_gib_per_gpu": 16 * total_params / world / GIB},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "data": {"tokens_per_rank_per_step": args.tokens, "valid_labels_per_step_all_ranks": valid,
                 "docs_per_rank_per_step": [[len(b["doc_lens"]) for b in s] for s in per_step]},
        "mfu": {"formula": "(6 * active_matmul_params * tokens + 6 * layers * q_heads * head_dim * sum(doc_len**2)) "
                           "/ (seconds * world * peak_flops); routed experts count top_k/E; veomni.train.metrics",
                "active_matmul_params": n_active, "peak_flops": peak_flops(device),
                "flops_per_step_all_ranks": flops},
        "contenders": {},
        "ratios": {},
    }  # fmt: skip
    if rank0:
        _write(args.out, result)
        print(f"[bench_moe] {result['model']}: {total_params / 1e9:.2f}B params, {n_active / 1e9:.2f}B active; "
              f"world {world}, ep {args.ep}; saving initial weights to {weights}", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        save_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        save_initial_weights(config, weights, args.seed, save_dtype, device)
        print(f"[bench_moe] saved in {time.perf_counter() - t0:.1f} s", flush=True)
    dist.barrier()
    for name in CONTENDERS:
        if name not in args.contenders:
            continue
        if rank0:
            print(f"[bench_moe] {name} ...", flush=True)
        try:
            record = run_contender(name, args, weights, device, steps, flops)
        except Exception as err:  # noqa: BLE001 - a failing contender (OOM, say) is a result to report
            traceback.print_exc()
            record = {"error": f"{type(err).__name__}: {err}"[:800]}
        _free(device)
        result["contenders"][name] = _agree(record)
        result["ratios"] = _ratios(result["contenders"])
        if rank0:
            _write(args.out, result)
            print(f"[bench_moe] {name} done; results written to {args.out}", flush=True)
    if rank0:
        _print_table(result)
        return result
    return None


def _versions() -> dict[str, str]:
    import importlib.metadata

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton,
            "python": platform.python_version()}  # fmt: skip


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``veomni/hf`` and ``veomni/veomni_head_in_root`` (tokens/s per GPU, peak memory), where both ran."""
    ratios = {}
    for name, other in (("veomni", "hf"), ("veomni", "veomni_head_in_root")):
        ours, theirs = results.get(name, {}), results.get(other, {})
        if "tokens_per_s_per_gpu" not in ours or "tokens_per_s_per_gpu" not in theirs:
            continue
        ratio = {"tokens_per_s_per_gpu": ours["tokens_per_s_per_gpu"] / theirs["tokens_per_s_per_gpu"]}
        if "peak_memory_gib" in ours and "peak_memory_gib" in theirs:
            ratio["peak_memory"] = ours["peak_memory_gib"] / theirs["peak_memory_gib"]
        ratios[f"{name}/{other}"] = ratio
    return ratios


def _print_table(result: dict[str, Any]) -> None:
    print(f"{result['model']} on {result['world_size']} x {result['device']}, "
          f"{result['data']['tokens_per_rank_per_step']} tokens/rank/step")  # fmt: skip
    print(f"{'contender':10s} {'tok/s/gpu':>11s} {'MFU':>7s} {'peak GiB':>9s} {'step ms':>9s} {'loss[0]':>9s} "
          f"{'final loss':>11s}  experts")  # fmt: skip
    for name, r in result["contenders"].items():
        if "tokens_per_s_per_gpu" not in r:
            print(f"{name:10s} {r.get('error')}")
            continue
        mfu = f"{r['mfu'] * 100:6.1f}%" if r["mfu"] is not None else "    n/a"
        mem = f"{r['peak_memory_gib']:9.2f}" if "peak_memory_gib" in r else "      n/a"
        print(f"{name:10s} {r['tokens_per_s_per_gpu']:11,.0f} {mfu} {mem} {r['median_step_ms']:9.1f} "
              f"{r['losses'][0]:9.5f} {r['final_loss']:11.5f}  {r['experts_implementation']}")  # fmt: skip
    for pair, ratio in result["ratios"].items():
        extra = f", memory x{ratio['peak_memory']:.3f}" if "peak_memory" in ratio else ""
        print(f"{pair}: tok/s/gpu x{ratio['tokens_per_s_per_gpu']:.3f}{extra}", flush=True)


if __name__ == "__main__":
    main()
