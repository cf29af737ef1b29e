"""Wan2.1-T2V-1.3B training steps (T9): veomni against plain diffusers (and each of its attention backends) on the
same latents, side by side in one process, JSON out.

    python3 tools/bench/bench_dit.py --out dit.json [--contenders diffusers,veomni,...] [--steps 3 --warmup 1]
    python3 tools/bench/bench_dit.py --out smoke.json --size tiny --device cpu --precision fp32   # CPU parity

Model: diffusers' ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's published config (written inline, nothing
downloaded; 30 blocks of 12 heads x 128, FFN 8960, text_dim 4096), initialised once by diffusers (seeded, fp32),
saved with ``save_pretrained`` to a temporary directory and loaded by every contender (each in its own way).

Data (seeded; the same tensors for every contender): per sample a VAE posterior ``[1, 32, 21, 60, 104]`` (480x832,
81 frames; mean = Wan's ``latents_mean + latents_std * N(0, 1)``, log-variance -8) and prompt embeddings
``[1, 512, 4096]`` (N(0, 1)), turned into the transformer's inputs by `veomni.models.wan.condition.
flow_matching_inputs`, the function `veomni.train.tasks.dit.DitTask` calls on stored conditions (posterior sample,
normalisation, timestep from the shifted flow-matching table, noising, velocity target; shift 3.0 as Wan2.1's
480p scheduler). Inputs are built before any contender runs and are not timed. 21 x 30 x 52 = 32,760 tokens/sample.

Contenders (`dit_contenders.py`): ``diffusers`` (its default attention backend), ``diffusers_<backend>`` (each
diffusers attention backend usable on this machine), ``diffusers_compiled`` (``compile_repeated_blocks``),
``veomni`` (veomni-train's one-rank path, diffusers' attention code), ``veomni_kernels`` (veomni's RMSNorm / rotary /
attention kernels bound, eager blocks), ``veomni_keep_attention`` (those with ``ac_keep_attention``) and
``veomni_compiled`` (the kernels and veomni's per-block compile: ``OpsConfig(compile="on")``). Same parameters
trained, same AdamW (fused, same groups and hyper-parameters), same dtype policy (``--precision``: parameters,
gradients, AdamW state; ``_keep_in_fp32_modules`` fp32), same activation checkpointing (``--ac``, default on:
without it one 480p x 81 sample needs far more than 80 GB). Contenders run one after the other in this process
(diffusers, the eager veomni ones, the backends, then the two compiled ones), each freed before the next (peak memory reset per
contender); compiled ones start from ``torch._dynamo.reset()``.

Each: warm-up steps, then timed steps (synchronised per step): samples/s, tokens/s, MFU (`DitFlops`: 6 x matmuls
+ attention, recomputation not counted), median step time, peak allocated memory, per-step losses and grad
norms (step 0's loss shows parity: same weights and inputs give the same loss up to kernel rounding). The JSON
is rewritten after every contender, so a time-out keeps what finished; ``--time-budget-s`` starts no contender
after that many seconds (recorded as skipped).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from veomni.models.diffusers.flow_matching import FlowMatchingSchedule
from veomni.models.wan.condition import flow_matching_inputs
from veomni.models.wan.rules import weight_counts as wan_weight_counts
from veomni.train.loop import setup_distributed
from veomni.train.metrics import peak_flops
from veomni.train.tasks.dit import DitFlops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers and contenders live beside this
from bench_common import worst  # noqa: E402
from bench_e2e import _compile_seconds, _free, _sync  # noqa: E402
from dit_contenders import (  # noqa: E402
    BUILDERS,
    NOT_BY_DEFAULT,
    WAN_T2V_1_3B,
    DitSettings,
    backend_contenders,
    backend_problem,
    builder,
    contender_problem,
    param_dtypes,
)

GIB = 2**30
# The same architecture shrunk for CPU runs (head_dim 12 splits into Wan's t/h/w rotary thirds of 4).
TINY: dict[str, Any] = WAN_T2V_1_3B | {
    "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4, "out_channels": 4, "text_dim": 32,
    "freq_dim": 16, "ffn_dim": 40, "num_layers": 2,
}  # fmt: skip
# Per size: the transformer config, the latent [C, F, H, W] of one sample, the prompt embeddings [L, D].
SIZES: dict[str, tuple[dict[str, Any], tuple[int, int, int, int], tuple[int, int]]] = {
    "full": (WAN_T2V_1_3B, (16, 21, 60, 104), (512, 4096)),  # 480x832, 81 frames through Wan's VAE (4x8x8)
    "tiny": (TINY, (4, 3, 8, 8), (16, 32)),
}
SHIFT = 3.0  # Wan2.1 T2V 480p scheduler flow_shift
# Run order: the two eager paths, then diffusers' backends (cheap), then the compiled pair (compiling takes a while).
FIRST, LAST = (
    ("diffusers", "veomni", "veomni_kernels", "veomni_keep_attention", "veomni_fa4"),
    ("veomni_compiled", "diffusers_compiled"),
)


def vae_config(z_dim: int) -> dict[str, Any]:
    """Wan's VAE statistics (``AutoencoderKLWan``'s defaults: those of Wan2.1's VAE), first ``z_dim`` channels."""
    from diffusers import AutoencoderKLWan

    defaults = inspect.signature(AutoencoderKLWan.__init__).parameters
    mean, std = defaults["latents_mean"].default, defaults["latents_std"].default
    if z_dim > len(mean):
        raise ValueError(f"z_dim {z_dim} exceeds Wan's {len(mean)} VAE channels")
    return {"z_dim": z_dim, "latents_mean": list(mean[:z_dim]), "latents_std": list(std[:z_dim])}


def make_steps(
    count: int, batch: int, size: str, dtype: torch.dtype, seed: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``batch`` samples, built as `DitTask` builds stored conditions (module docstring).

    Returns:
        dicts on ``device``: ``hidden_states`` ``[B, C, F, H, W]`` and ``encoder_hidden_states`` ``[B, L, D]`` in
        ``dtype``; ``timestep`` float32 ``[B]`` (values of the schedule's ``timesteps()``); ``target`` float32
        ``[B, C, F, H, W]`` (``noise - latents``).
    """
    _, (channels, frames, height, width), (text_len, text_dim) = SIZES[size]
    vae = vae_config(channels)
    mean = torch.tensor(vae["latents_mean"]).view(1, channels, 1, 1, 1)
    std = torch.tensor(vae["latents_std"]).view(1, channels, 1, 1, 1)
    schedule = FlowMatchingSchedule(num_train_timesteps=1000, shift=SHIFT)
    data = torch.Generator().manual_seed(seed)
    steps = []
    for i in range(count):
        shape = (1, channels, frames, height, width)
        posteriors = [
            torch.cat([mean + std * torch.randn(shape, generator=data), torch.full(shape, -8.0)], dim=1)
            for _ in range(batch)
        ]
        prompts = [torch.randn(1, text_len, text_dim, generator=data) for _ in range(batch)]
        made = flow_matching_inputs(
            {"latent_params": posteriors, "prompt_embeds": prompts}, vae_config=vae, schedule=schedule,
            generator=torch.Generator().manual_seed(seed * 100_003 + i),
        )  # fmt: skip
        steps.append({
            "hidden_states": torch.cat(made["hidden_states"]).to(device, dtype),
            "timestep": torch.cat(made["timestep"]).to(device),
            "encoder_hidden_states": torch.cat(made["encoder_hidden_states"]).to(device, dtype),
            "target": torch.cat(made["training_target"]).to(device),
        })  # fmt: skip
    return steps


def save_initial_weights(config: dict[str, Any], path: str, seed: int, device: torch.device) -> None:
    """diffusers' own init of ``config`` (fp32, seeded, built on ``device``), ``save_pretrained`` to ``path``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel.from_config(config)
    model.to("cpu").save_pretrained(path)
    del model
    _free(device)


def run_contender(
    name: str, s: DitSettings, steps: list[dict[str, torch.Tensor]], warmup: int, sample_flops: float,
    tokens_per_sample: int,
) -> dict[str, Any]:  # fmt: skip
    """Build ``name``, run ``steps`` (the first ``warmup`` untimed), free it; return its JSON record."""
    device = s.device
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if name.endswith("_compiled"):
        torch._dynamo.reset()
    compile_before = _compile_seconds()
    t0 = time.perf_counter()
    contender = builder(name)(s)
    build_s = time.perf_counter() - t0
    losses, norms, seconds = [], [], []
    graphs_after_warmup = None
    for i, batch in enumerate(steps):
        if i == warmup and contender.compile_stats is not None:
            graphs_after_warmup = contender.compile_stats.graphs
        _sync(device)
        t0 = time.perf_counter()
        loss, norm = contender.step(batch)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
        norms.append(norm)
    record: dict[str, Any] = dict(contender.info)
    record["param_dtypes"] = param_dtypes(contender.model)
    record["trainable_params"] = sum(p.numel() for p in contender.model.parameters() if p.requires_grad)
    if name.endswith("_compiled"):
        record["compile_s"] = _compile_seconds() - compile_before
    if contender.compile_stats is not None:
        stats = contender.compile_stats
        record |= {"graphs_compiled": stats.graphs, "graphs_after_warmup": graphs_after_warmup,
                   "recompiles_after_warmup": None if graphs_after_warmup is None else stats.graphs - graphs_after_warmup}  # fmt: skip
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        record["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        record["memory_before_build_gib"] = base / GIB
    del contender
    if name.endswith("_compiled"):
        torch._dynamo.reset()  # compiled graphs and their caches go too
    _free(device)
    if device.type == "cuda":
        record["memory_after_free_gib"] = torch.cuda.memory_allocated(device) / GIB
    timed = seconds[warmup:]
    samples = sum(int(b["target"].shape[0]) for b in steps[warmup:])
    peak = peak_flops(device)
    record |= {
        "build_s": build_s,
        "losses": [float(x) for x in losses],
        "grad_norms": [float(x) for x in norms],
        "first_step_s": seconds[0],
        "step_s": timed,
        "median_step_s": statistics.median(timed),
        "samples_per_s": samples / sum(timed),
        "tokens_per_s": samples * tokens_per_sample / sum(timed),
        "mfu": samples * sample_flops / sum(timed) / peak if peak else None,
    }
    return record


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Every measured contender against ``diffusers`` (samples/s and peak memory ratios)."""
    base = results.get("diffusers", {})
    out = {}
    for name, r in results.items():
        if name == "diffusers" or "samples_per_s" not in r or "samples_per_s" not in base:
            continue
        ratio = {"samples_per_s": r["samples_per_s"] / base["samples_per_s"]}
        if "peak_memory_gib" in r and "peak_memory_gib" in base:
            ratio["peak_memory"] = r["peak_memory_gib"] / base["peak_memory_gib"]
        out[f"{name}/diffusers"] = ratio
    return out


def target_check(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """T9 (>= 1.5x plain diffusers' samples/s at <= its peak memory) for each veomni contender, also against the
    fastest diffusers contender of the run."""
    diffusers = {n: r for n, r in results.items() if n.startswith("diffusers") and "samples_per_s" in r}
    best = max(diffusers, key=lambda n: diffusers[n]["samples_per_s"], default=None)
    out: dict[str, Any] = {"rule": "samples_per_s >= 1.5 x diffusers and peak_memory <= diffusers",
                           "fastest_diffusers": best}  # fmt: skip
    for name in ("veomni", "veomni_kernels", "veomni_keep_attention", "veomni_compiled"):
        r, base = results.get(name, {}), results.get("diffusers", {})
        if "samples_per_s" not in r or "samples_per_s" not in base:
            continue
        speed = r["samples_per_s"] / base["samples_per_s"]
        memory = r["peak_memory_gib"] / base["peak_memory_gib"] if "peak_memory_gib" in base else None
        out[name] = {"speed_vs_diffusers": speed, "memory_vs_diffusers": memory,
                     "met": speed >= 1.5 and memory is not None and memory <= 1.0,
                     "speed_vs_fastest_diffusers": r["samples_per_s"] / diffusers[best]["samples_per_s"]}  # fmt: skip
    return out


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit(given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", required=True, help="where to write the JSON results")
    add("--contenders", default=None,
        help="comma-separated; default: diffusers, veomni, veomni_compiled, diffusers_compiled and every usable "
             "diffusers_<backend> (backends that cannot fit at 480p are recorded as skipped)")  # fmt: skip
    add(
        "--size",
        choices=tuple(SIZES),
        default="full",
        help="full: Wan2.1-T2V-1.3B at 480p x 81; tiny: CPU runs",
    )
    add("--batch", type=int, default=1, help="samples per step")
    add("--warmup", type=int, default=1, help="untimed optimizer steps first")
    add("--steps", type=int, default=3, help="timed optimizer steps")
    add("--seed", type=int, default=0, help="weights use seed, data seed + 1")
    add("--lr", type=float, default=1e-5)
    add("--weight-decay", type=float, default=0.01)
    add("--max-grad-norm", type=float, default=1.0)
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="parameters, gradients and AdamW state for every contender (fp32: a parity check)")  # fmt: skip
    add(
        "--ac",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing of every block, for everyone",
    )
    add("--compile-backend", default="inductor", help="dynamo backend of the *_compiled contenders")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--tmpdir", default=None, help="where the initial weights are saved (default: system temp)")
    add("--time-budget-s", type=float, default=None,
        help="start no contender after this many seconds of the run (each is recorded as skipped)")  # fmt: skip
    add(
        "--commit",
        default=None,
        help="recorded in the JSON (default: git rev-parse HEAD, when there is a .git)",
    )
    args = p.parse_args(argv)
    for flag in ("batch", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.contenders is not None:
        args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
        known = (*BUILDERS, *backend_contenders())
        unknown = sorted(set(args.contenders) - set(known))
        if unknown or not args.contenders:
            p.error(f"--contenders: unknown {unknown} (choose from {known})" if unknown else "--contenders is empty")  # fmt: skip
    return args


def plan(
    requested: list[str] | None, device: torch.device, dtype: torch.dtype
) -> list[tuple[str, str | None]]:
    """``(name, why it is skipped or None)`` in run order: `FIRST`, the backends in diffusers' order, `LAST`."""
    backends = backend_contenders()
    order = (*FIRST, *backends, *LAST)
    names = list(order) if requested is None else [n for n in order if n in requested]
    out = []
    for name in names:
        problem = contender_problem(name, device)
        if name in backends:
            problem = backend_problem(backends[name], device, dtype)
            if problem is None and requested is None and backends[name] in NOT_BY_DEFAULT:
                problem = (
                    f"not run by default: {NOT_BY_DEFAULT[backends[name]]}; name it in --contenders to run it"
                )
        out.append((name, problem))
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write ``--out`` and print a table; returns the JSON object."""
    args = parse_args(argv)
    created_group = not dist.is_initialized()
    device = setup_distributed(args.device)
    try:
        if dist.get_world_size() != 1:
            raise SystemExit(f"bench_dit runs in one process; the world size is {dist.get_world_size()}")
        return _run(args, device)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import diffusers
    import transformers
    from diffusers import WanTransformer3DModel

    started = time.perf_counter()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    config, latent, text = SIZES[args.size]
    tokens = (
        (latent[1] // config["patch_size"][0])
        * (latent[2] // config["patch_size"][1])
        * (latent[3] // config["patch_size"][2])
    )
    with torch.device("meta"):
        probe = WanTransformer3DModel.from_config(config)
    flops = DitFlops.from_counts(wan_weight_counts(probe), text_len=text[0], image_len=0)
    del probe
    steps = make_steps(args.warmup + args.steps, args.batch, args.size, dtype, args.seed + 1, device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__, "accelerate": _version("accelerate"),
                     "python": platform.python_version()},
        "commit": _commit(args.commit),
        "model": "Wan2.1-T2V-1.3B transformer (random init)" if args.size == "full" else "tiny Wan (smoke)",
        "config": config,
        "data": {"latent_per_sample": list(latent), "text_per_sample": list(text), "tokens_per_sample": tokens,
                 "samples_per_step": args.batch, "shift": SHIFT,
                 "timesteps": [s["timestep"].tolist() for s in steps]},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "diffusers_attn_backend_env": os.environ.get("DIFFUSERS_ATTN_BACKEND"),
        "flops": {"per_sample": flops.sample(tokens), "formula": "veomni.train.tasks.dit.DitFlops (6 x matmuls + "
                  "12 x layers x width x S x (S + text_len)); recomputation not counted", "peak_flops": peak_flops(device)},
        "contenders": {},
    }  # fmt: skip
    results: dict[str, dict[str, Any]] = result["contenders"]
    with tempfile.TemporaryDirectory(prefix="bench_dit_", dir=args.tmpdir) as weights:
        save_initial_weights(config, weights, args.seed, device)
        settings = DitSettings(
            device=device, weights=weights, dtype=dtype, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
            weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, ac=args.ac == "on",
            compile_backend=args.compile_backend,
        )  # fmt: skip
        for name, problem in plan(args.contenders, device, dtype):
            elapsed = time.perf_counter() - started
            if not problem and args.time_budget_s is not None and elapsed > args.time_budget_s:
                problem = f"time budget: {elapsed:.0f} s had passed of --time-budget-s {args.time_budget_s:g}"
            if problem:
                results[name] = {"skipped": problem}
                continue
            print(f"[bench_dit] {name} ...", file=sys.stderr, flush=True)
            try:
                results[name] = run_contender(
                    name, settings, steps, args.warmup, flops.sample(tokens), tokens
                )
            except Exception as err:  # noqa: BLE001 - a failing contender (OOM, say) is a result to report
                traceback.print_exc()
                results[name] = {"error": f"{type(err).__name__}: {err}"[:800]}
                _free(device)
            _write(result, args.out)
    _write(result, args.out)
    _print_table(result)
    return result


def _write(result: dict[str, Any], path: str) -> None:
    runs = result["contenders"]
    result["ratios"] = ratios(runs)
    result["target_t9"] = target_check(runs)
    losses = {n: r["losses"][0] for n, r in runs.items() if "losses" in r}
    base = losses.get("diffusers")
    result["parity"] = {
        "step0_loss": losses,
        "max_rel_diff_vs_diffusers": None if base is None or len(losses) < 2
        else worst(abs(v - base) / abs(base) for v in losses.values()),  # NaN if a loss is NaN
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _print_table(result: dict[str, Any]) -> None:
    data = result["data"]
    print(f"{result['model']} on {result['device']}: {data['samples_per_step']} sample(s)/step, "
          f"{data['tokens_per_sample']} tokens/sample")  # fmt: skip
    print(f"{'contender':28s} {'samples/s':>10s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>9s} {'step s':>7s} "
          f"{'loss[0]':>10s} {'loss[-1]':>10s}")  # fmt: skip
    for name, r in result["contenders"].items():
        if "samples_per_s" not in r:
            print(f"{name:28s} {r.get('skipped') or r.get('error')}")
            continue
        mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "   n/a"
        mem = f"{r['peak_memory_gib']:9.2f}" if "peak_memory_gib" in r else "      n/a"
        print(f"{name:28s} {r['samples_per_s']:10.4f} {r['tokens_per_s']:9.0f} {mfu} {mem} {r['median_step_s']:7.3f} "
              f"{r['losses'][0]:10.6f} {r['losses'][-1]:10.6f}")  # fmt: skip
    for pair, ratio in result["ratios"].items():
        print(f"{pair}: " + ", ".join(f"{k} x{v:.3f}" for k, v in ratio.items()))


if __name__ == "__main__":
    main()
