"""MoE blocks fwd+bwd, veomni vs HF transformers: gpt-oss, DeepSeek-V3 and Qwen3-VL-MoE MoE blocks, JSON out.

    python tools/bench/bench_families.py --out families.json [--blocks gpt_oss,deepseek_v3,qwen3_vl_moe]
        [--tokens 8192]
        [--hf-impls eager,grouped_mm,batched_mm,deepgemm,sonicmoe] [--dsv3-experts 256] [--size full|tiny]
        [--compile [--compile-backend inductor]] [--profile DIR]

Blocks (bf16 on CUDA; ``--size tiny`` runs small shapes in fp32 on the CPU: the parity check the tests run):

- ``gpt_oss``: ``GptOssMLP`` = the biased top-k router + ``GptOssExperts`` (biased, transposed weights with gate and
  up interleaved column by column, clamped SwiGLU), at gpt-oss-20b's layer: E=32, top-4, H=2880, I=2880.
- ``deepseek_v3``: ``DeepseekV3MoE`` = the group-limited sigmoid router (fp32 scores, fp32 correction bias), 256
  routed experts top-8 and one shared expert, at DeepSeek-V3's layer: H=7168, moe I=2048, n_group 8, topk_group 4.
  Fits one 80 GB GPU uncut at 8192 tokens (weights 22.7 GB in bf16 plus as much again for their gradients);
  ``--dsv3-experts`` cuts the routed experts (recorded as ``cut`` in the JSON).
- ``qwen3_vl_moe``: ``Qwen3VLMoeTextSparseMoeBlock`` = the softmax top-k router + experts (``[E, 2I, H]`` gate/up,
  ``[E, H, I]`` down), at Qwen3-VL-30B-A3B's language-model layer: E=128, top-8, H=2048, moe I=768.

Contenders, for each block, in this order:

- ``hf_<impl>``: transformers' own class, experts dispatched by ``config._experts_implementation = impl``. The
  first is the one transformers picks by default (what ``<Family>ForCausalLM(config)`` sets; ``grouped_mm`` in
  5.23), then the other names of ``--hf-impls``. Skipped with the reason: ``eager`` (a Python loop over experts
  whose backward builds a full-size weight gradient per expert) above ``--hf-eager-max-experts`` on CUDA,
  ``batched_mm`` (gathers one ``[2I, H]`` + ``[H, I]`` weight copy per routed row) when that copy exceeds the free
  memory, ``deepgemm``/``sonicmoe`` without the ``kernels`` package (they load their kernels from the Hub).
- ``veomni_<backend>`` for ``torch`` and ``triton`` (``--veomni-backends``): the same block from veomni's generated
  modeling file after ``apply_ops(block, OpsConfig(moe_experts=backend))`` (other ops at the hardware default: the
  shared expert's SwiGLU is the Triton kernel on CUDA) with experts implementation ``"veomni"``: gpt-oss's experts
  are claimed for ``moe_experts/clamped_routed``, DeepSeek-V3's run ``moe_experts/routed``. Routers stay upstream's
  on both sides. Nothing is ``torch.compile``d on either side, except with ``--compile``: then HF's default
  (``hf_<impl>_compiled``) and veomni's torch backend (``veomni_torch_compiled``) also run as
  ``torch.compile(block)``, as a compiled decoder layer would (inductor fuses the router and the glue;
  ``--compile-backend`` picks another dynamo backend, e.g. ``aot_eager`` for the CPU smoke test).

Every contender shares the same parameter tensors (one copy in memory), input and upstream gradient, so routing is
identical. A step is ``out = block(hidden)`` then ``torch.autograd.grad`` for the input and every parameter (no
``.grad`` accumulation). Reported per contender: median fwd+bwd ms, forward ms (no_grad), tokens/s, TFLOP/s, peak
extra memory of one step (allocator peak minus what was allocated before: weights and inputs excluded, the returned
gradients included; ``peak_extra_minus_grads_mib`` without them), and the max absolute and relative (Frobenius)
errors of its output, input gradient and parameter gradients against the reference contender (the first HF one
that ran; expert weight gradients compared on experts 0-3). ``agrees``: every relative error within 2e-2 in bf16
(1e-4 in fp32). ``speedup_vs_<hf>`` = HF ms / ours ms (= tokens/s ours / HF), ``peak_ratio_vs_<hf>`` = ours / HF.

``--profile DIR``: after its timing, each contender runs 3 more fwd+bwd steps under torch.profiler (CPU, and CUDA
activities on a GPU) and writes ``DIR/<block>-<contender>.txt``: the ``key_averages`` table of the top 40 ops by self
CUDA time (self CPU time off CUDA; on CUDA a second table by self CPU time follows). The row records the file name
(``profile``, relative to ``profile_dir`` at the top of the JSON) and, on CUDA, ``gpu_busy_fraction`` of those steps.

FLOPs counted: expert GEMMs ``18 * T * k * H * I`` (gate/up ``[H, 2I]`` and down, forward + dgrad + wgrad), the
shared expert ``18 * T * H * I_shared``, the router ``6 * T * H * E``; gathers, activations and combine not counted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common lives beside this script
from bench_common import (  # noqa: E402
    environment,
    error_text,
    max_abs,
    measured_call,
    profile_calls,
    rel_err,
    release,
    timed_row,
    worst,
    write_json,
)

BLOCKS = ("gpt_oss", "deepseek_v3", "qwen3_vl_moe")
SHAPES: dict[str, dict[str, dict[str, int]]] = {
    "full": {
        "gpt_oss": {"experts": 32, "top_k": 4, "hidden": 2880, "inter": 2880},
        "deepseek_v3": {"experts": 256, "top_k": 8, "hidden": 7168, "inter": 2048, "n_group": 8,
                        "topk_group": 4, "shared": 1},
        "qwen3_vl_moe": {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768},
    },
    "tiny": {
        "gpt_oss": {"experts": 4, "top_k": 2, "hidden": 32, "inter": 16},
        "deepseek_v3": {"experts": 8, "top_k": 2, "hidden": 32, "inter": 16, "n_group": 4, "topk_group": 2,
                        "shared": 1},
        "qwen3_vl_moe": {"experts": 8, "top_k": 2, "hidden": 32, "inter": 16},
    },
}  # fmt: skip
# block -> (transformers module, veomni generated module, block class, causal-LM class, routed kernel variant)
MODULES: dict[str, tuple[str, str, str, str, str]] = {
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss",
                "veomni.models.gpt_oss.generated.patched_modeling_gpt_oss", "GptOssMLP", "GptOssForCausalLM",
                "clamped_routed"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3",
                    "veomni.models.deepseek_v3.generated.patched_modeling_deepseek_v3", "DeepseekV3MoE",
                    "DeepseekV3ForCausalLM", "routed"),
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
                     "veomni.models.qwen3_vl_moe.generated.patched_modeling_qwen3_vl_moe",
                     "Qwen3VLMoeTextSparseMoeBlock", "Qwen3VLMoeTextModel", "routed"),
}  # fmt: skip
HF_IMPLS = ("eager", "grouped_mm", "batched_mm", "deepgemm", "sonicmoe")
VEOMNI_BACKENDS = ("torch", "triton")
# Relative (Frobenius) error of the output and input gradient under which two contenders agree.
PROFILE_STEPS = 3  # fwd+bwd steps per contender under torch.profiler (--profile)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def block_config(block: str, shape: dict[str, int]) -> Any:
    """The transformers config of one layer of ``block`` at ``shape`` (attention fields at their defaults)."""
    if block == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_local_experts=shape["experts"],
            num_experts_per_tok=shape["top_k"], num_hidden_layers=1, vocab_size=128,
        )  # fmt: skip
    if block == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeTextConfig

        return Qwen3VLMoeTextConfig(
            hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"], num_experts=shape["experts"],
            num_experts_per_tok=shape["top_k"], num_hidden_layers=1, vocab_size=128,
        )  # fmt: skip
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"], n_routed_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], n_group=shape["n_group"], topk_group=shape["topk_group"],
        n_shared_experts=shape["shared"], norm_topk_prob=True, routed_scaling_factor=2.5, num_hidden_layers=1,
        first_k_dense_replace=0, vocab_size=128,
    )  # fmt: skip


def hf_default_experts_impl(block: str, shape: dict[str, int]) -> str:
    """The experts implementation transformers picks for ``block``'s causal LM when none is requested (meta build)."""
    upstream = importlib.import_module(MODULES[block][0])
    with torch.device("meta"):
        model = getattr(upstream, MODULES[block][3])(block_config(block, shape))
    return model.config._experts_implementation


def flops(block: str, shape: dict[str, int], tokens: int) -> float:
    """fwd+bwd FLOPs of one block step (see the module doc for what is counted)."""
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    total = 18.0 * tokens * shape["top_k"] * h * i + 6.0 * tokens * h * e
    return total + 18.0 * tokens * h * i * shape.get("shared", 0)


def _fan_in(block: str, name: str, shape: tuple[int, ...]) -> int:
    if len(shape) == 3:  # gpt-oss stores experts as [E, in, out], DeepSeek-V3 (HF's default) as [E, out, in]
        return shape[1] if block == "gpt_oss" else shape[2]
    return shape[-1]


def init_tensors(
    template: nn.Module, block: str, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded values for every parameter and buffer of ``template`` (a meta-device block), by name.

    Weights ``N(0, 1 / fan_in)`` and biases ``N(0, 0.05^2)`` in ``dtype``; DeepSeek-V3's
    ``e_score_correction_bias`` ``N(0, 0.05^2)`` in fp32 (``from_pretrained`` keeps it fp32).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    values = {}
    for name, p in template.named_parameters():
        std = 0.05 if p.dim() == 1 else _fan_in(block, name, tuple(p.shape)) ** -0.5
        values[name] = torch.randn(p.shape, generator=gen, device=device, dtype=dtype).mul_(std)
    for name, b in template.named_buffers():
        values[name] = torch.randn(b.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.05)
    return values


def share_into(module: nn.Module, params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor]) -> None:
    """Make ``module`` (built on meta) use exactly these Parameter objects and buffers; names must match."""
    have = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    if have != set(params) | set(buffers):
        raise ValueError(
            f"{type(module).__name__}: tensors {sorted(have)} differ from {sorted(params | buffers)}"
        )
    for name, value in [*params.items(), *buffers.items()]:
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, value)


def build_hf(block: str, shape: dict[str, int], impl: str) -> nn.Module:
    """transformers' block class on meta with ``config._experts_implementation = impl``."""
    upstream = importlib.import_module(MODULES[block][0])
    config = block_config(block, shape)
    config._experts_implementation = impl
    with torch.device("meta"):
        return getattr(upstream, MODULES[block][2])(config)


def build_veomni(block: str, shape: dict[str, int]) -> nn.Module:
    """veomni's generated block class on meta, experts implementation ``"veomni"`` (kernels bound later)."""
    from veomni.models.hf.experts import register_hf_experts

    # Imported before the meta context: importing it runs the experts claim (a CPU probe of the gate).
    ours = importlib.import_module(MODULES[block][1])
    config = block_config(block, shape)
    config._experts_implementation = register_hf_experts()
    with torch.device("meta"):
        return getattr(ours, MODULES[block][2])(config)


def hf_skip_reason(impl: str, shape: dict[str, int], tokens: int, dtype: torch.dtype, cli: Any) -> str | None:
    """Why HF experts implementation ``impl`` is not run at this shape, or None."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.utils.import_utils import is_kernels_available

    if impl != "eager" and impl not in ALL_EXPERTS_FUNCTIONS:
        return f"not an experts implementation of this transformers (has {sorted(ALL_EXPERTS_FUNCTIONS)})"
    on_cuda = cli.device.type == "cuda"
    if impl == "eager" and on_cuda and shape["experts"] > cli.hf_eager_max_experts:
        return (
            f"E={shape['experts']} > --hf-eager-max-experts {cli.hf_eager_max_experts}: the per-expert loop's "
            "backward builds one full-size [E, ...] weight gradient per expert (select backward) and sums them"
        )
    if impl == "batched_mm":
        rows = tokens * shape["top_k"]
        need = rows * 3 * shape["hidden"] * shape["inter"] * torch.finfo(dtype).bits // 8
        free = torch.cuda.mem_get_info(cli.device)[0] if on_cuda else 4 * 2**30
        if need > 0.8 * free:
            return (
                f"gathers a [2I, H] + [H, I] weight copy per routed row: {need / 2**30:.0f} GiB for {rows} rows, "
                f"free {free / 2**30:.0f} GiB"
            )
    if impl in ("deepgemm", "sonicmoe") and not is_kernels_available():
        return "needs the `kernels` package (it loads its kernel from the Hugging Face Hub); not installed"
    return None


def _kept(name: str, grad: torch.Tensor) -> torch.Tensor:
    # Expert weight gradients are [E, ...]: keep experts 0-3 (a DeepSeek-V3 copy would be 22 GB).
    return (grad[:4] if grad.dim() == 3 else grad).detach().clone()


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Errors of one contender's kept tensors (``out``, ``d_hidden``, ``d_<param>``) against the reference's."""
    result: dict[str, Any] = {}
    for key in ("out", "d_hidden"):
        result[key] = {"max_abs": max_abs(got[key], want[key]), "rel": rel_err(got[key], want[key])}
    params = {k: rel_err(got[k], want[k]) for k in want if k.startswith("d_") and k != "d_hidden"}
    result["d_params_rel"] = params
    result["d_params_max_rel"] = worst(params.values())
    return result


def agrees(errs: dict[str, Any], tol: float) -> bool:
    """True when the output, the input gradient and every kept parameter gradient are within ``tol`` (relative);
    False when any of those errors is NaN."""
    return worst((errs["out"]["rel"], errs["d_hidden"]["rel"], errs["d_params_max_rel"])) <= tol


def run_contender(
    name: str, module: nn.Module, block: str, inputs: dict[str, torch.Tensor], cli: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Time one contender; returns its row and its kept tensors for the parity check."""
    names = [n.removeprefix("_orig_mod.") for n, _ in module.named_parameters()]  # torch.compile's wrapper
    leaves = [inputs["hidden"], *(p for _, p in module.named_parameters())]

    def forward() -> torch.Tensor:
        out = module(inputs["hidden"])
        return out[0] if isinstance(out, tuple) else out  # GptOssMLP returns (hidden, router_scores)

    def step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = forward()
        return out, torch.autograd.grad(out, leaves, inputs["grad"])

    (out, grads), first_ms, _ = measured_call(step, cli.device)  # compile / first-call allocations
    kept = {"out": out.detach().clone(), "d_hidden": grads[0].detach().clone()}
    kept |= {f"d_{n}": _kept(n, g) for n, g in zip(names, grads[1:], strict=True)}
    grads_mib = sum(g.numel() * g.element_size() for g in grads) / 2**20
    del out, grads
    row = {"first_call_ms": first_ms, **timed_row(step, forward, cli.device, cli.reps)}
    if row["peak_extra_mib"] is not None:  # the returned gradients are the same size for every contender
        row["peak_extra_minus_grads_mib"] = row["peak_extra_mib"] - grads_mib
    tokens = inputs["hidden"].shape[1]
    row["tokens_per_s"] = tokens / (row["ms"] / 1e3)
    row["tflops"] = flops(block, cli.shapes[block], tokens) / row["ms"] / 1e9
    if cli.profile:
        row |= profile_contender(step, f"{block}-{name}.txt", cli)
    return row, kept


def profile_contender(step: Callable[[], object], file_name: str, cli: Any) -> dict[str, Any]:
    """`PROFILE_STEPS` more calls of ``step`` (already warm) under torch.profiler; the top ops by self device
    time (self CPU time off CUDA) go to ``cli.profile/file_name``. Returns the row's profile fields."""

    def steps() -> None:
        for _ in range(PROFILE_STEPS):
            step()

    sort = "self_cuda_time_total" if cli.device.type == "cuda" else "self_cpu_time_total"
    path = os.path.join(cli.profile, file_name)
    busy = profile_calls(steps, cli.device, path, steps=PROFILE_STEPS, sort_by=sort)
    return {"profile": file_name, **(busy or {})}


def contenders(block: str, cli: Any) -> list[tuple[str, str, str, bool]]:
    """``(name, kind, impl, compiled)`` in run order: HF's default experts implementation first, then the others,
    then ours; with ``--compile`` also HF's default and our ``torch`` backend under ``torch.compile``."""
    default = hf_default_experts_impl(block, cli.shapes[block])
    hf = [default] + [i for i in cli.hf_impls if i != default]
    rows = [(f"hf_{i}", "hf", i, False) for i in hf]
    rows += [(f"veomni_{b}", "veomni", b, False) for b in cli.veomni_backends]
    if cli.compile:
        rows += [
            (f"hf_{default}_compiled", "hf", default, True),
            ("veomni_torch_compiled", "veomni", "torch", True),
        ]
    return rows


def bench_block(block: str, cli: Any, emit: Callable[[dict], None]) -> dict[str, Any]:
    """Every contender on ``block``; ``emit(partial)`` after each row. Returns the block's JSON section."""
    from veomni.kernels import KERNELS, OpsConfig, detect_hardware
    from veomni.kernels.config import DEFAULT_BACKENDS
    from veomni.models.hf.kernel_hooks import apply_ops

    shape, dtype, device = cli.shapes[block], cli.dtype, cli.device
    template = build_hf(block, shape, "eager")
    values = init_tensors(template, block, device, dtype, seed=0)
    param_names = {n for n, _ in template.named_parameters()}
    params = {n: nn.Parameter(v) for n, v in values.items() if n in param_names}
    buffers = {n: v for n, v in values.items() if n not in param_names}
    order = contenders(block, cli)
    gen = torch.Generator(device=device).manual_seed(1)
    size = (1, cli.tokens, shape["hidden"])
    inputs = {
        "hidden": torch.randn(size, generator=gen, device=device, dtype=dtype).requires_grad_(),
        "grad": torch.randn(size, generator=gen, device=device, dtype=dtype),
    }
    section: dict[str, Any] = {
        "shape": shape, "tokens": cli.tokens, "dtype": str(dtype), "class": MODULES[block][2],
        "weights_gib": sum(v.numel() * v.element_size() for v in values.values()) / 2**30,
        "flops_per_step": flops(block, shape, cli.tokens), "hf_default": order[0][2],
        "cut": cli.cuts.get(block), "rows": [],
    }  # fmt: skip
    reference: tuple[str, dict[str, torch.Tensor]] | None = None
    for name, kind, impl, compiled in order:
        row: dict[str, Any] = {"impl": name}
        section["rows"].append(row)
        if kind == "hf":
            reason = hf_skip_reason(impl, shape, cli.tokens, dtype, cli)
        else:
            spec = KERNELS.get("moe_experts", MODULES[block][4], impl)
            reason = spec.requires.unmet(detect_hardware())
        if reason:
            row["skipped"] = reason
            emit(section)
            continue
        module = None
        try:
            module = build_hf(block, shape, impl) if kind == "hf" else build_veomni(block, shape)
            share_into(module, params, buffers)
            row["experts_implementation"] = module.experts.config._experts_implementation
            if kind == "veomni":
                kernels = apply_ops(module, OpsConfig(moe_experts=impl))
                row["ops"] = {f: getattr(kernels.config, f) for f in DEFAULT_BACKENDS}
            if compiled:
                # The block as a compiled decoder layer would run it: inductor fuses the router and the
                # elementwise glue (gathers, biases, activation, combine) around the grouped GEMMs.
                torch._dynamo.reset()
                row["compiled"] = f"torch.compile(block), {cli.compile_backend}, dynamic=False"
                module = torch.compile(module, dynamic=False, backend=cli.compile_backend)
            timing, kept = run_contender(name, module, block, inputs, cli)
            row |= timing
            if reference is None:
                reference = (name, kept)
            row["reference"] = reference[0]
            row["errors"] = errors(kept, reference[1])
            row["agrees"] = agrees(row["errors"], TOLERANCE[dtype])
            del kept
        except Exception as err:  # noqa: BLE001 - a failing contender (OOM, unsupported) is a result
            row["error"] = error_text(err)
        del module
        release(device)
        emit(section)
    _ratios(section["rows"])
    return section


def _ratios(rows: list[dict[str, Any]]) -> None:
    hf = {r["impl"]: r for r in rows if r["impl"].startswith("hf_") and "ms" in r}
    for row in rows:
        if not row["impl"].startswith("veomni_") or "ms" not in row:
            continue
        for peer, ref in hf.items():
            row[f"speedup_vs_{peer}"] = ref["ms"] / row["ms"]
            if row.get("peak_extra_mib") and ref.get("peak_extra_mib"):
                row[f"peak_ratio_vs_{peer}"] = row["peak_extra_mib"] / ref["peak_extra_mib"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--size", choices=("full", "tiny"), default="full", help="tiny: small fp32 shapes on CPU"
    )
    parser.add_argument("--blocks", default=",".join(BLOCKS), help=f"comma-separated, of {BLOCKS}")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192; tiny 24)")
    parser.add_argument("--hf-impls", default=",".join(HF_IMPLS), help="HF experts implementations to try")
    parser.add_argument("--veomni-backends", default=",".join(VEOMNI_BACKENDS), help="moe_experts backends")
    parser.add_argument(
        "--hf-eager-max-experts", type=int, default=64, help="skip HF's eager loop above this E"
    )
    parser.add_argument(
        "--dsv3-experts", type=int, default=None, help="cut DeepSeek-V3's routed experts to E"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10; tiny 3)")
    parser.add_argument("--device", default=None, help="default: cuda if available (tiny: cpu)")
    parser.add_argument(
        "--compile", action="store_true", help="also HF's default and veomni torch under torch.compile"
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="dynamo backend of the *_compiled contenders"
    )
    parser.add_argument(
        "--profile", default=None, metavar="DIR", help="profile 3 more steps per contender: op tables to DIR/"
    )
    cli = parser.parse_args(argv)
    tiny = cli.size == "tiny"
    cli.blocks = [b for b in cli.blocks.split(",") if b]
    unknown = set(cli.blocks) - set(BLOCKS)
    if unknown:
        parser.error(f"unknown blocks {sorted(unknown)}; choose from {list(BLOCKS)}")
    cli.hf_impls = [i for i in cli.hf_impls.split(",") if i]
    cli.veomni_backends = [b for b in cli.veomni_backends.split(",") if b]
    cli.tokens = cli.tokens or (24 if tiny else 8192)
    cli.reps = cli.reps or (3 if tiny else 10)
    cli.device = torch.device(cli.device or ("cpu" if tiny or not torch.cuda.is_available() else "cuda"))
    if not tiny and cli.device.type != "cuda":
        parser.error("--size full needs a CUDA GPU (use --size tiny on CPU)")
    cli.dtype = torch.float32 if tiny else torch.bfloat16
    cli.shapes = {b: dict(s) for b, s in SHAPES[cli.size].items()}
    cli.cuts = {}
    if cli.dsv3_experts is not None:
        ds = cli.shapes["deepseek_v3"]
        groups, per = ds["n_group"], cli.dsv3_experts // ds["n_group"]
        if cli.dsv3_experts % groups or per < 2 or per * ds["topk_group"] < ds["top_k"]:
            parser.error(f"--dsv3-experts must be a multiple of n_group={groups} leaving >= 2 per group and "
                         f">= top_k={ds['top_k']} in the top {ds['topk_group']} groups")  # fmt: skip
        cli.cuts["deepseek_v3"] = f"routed experts {ds['experts']} -> {cli.dsv3_experts}"
        ds["experts"] = cli.dsv3_experts
    return cli


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cli = parse_args(argv)
    result: dict[str, Any] = {**environment(cli.device), "size": cli.size, "tokens": cli.tokens, "blocks": {}}
    if cli.profile:
        result["profile_dir"] = cli.profile
    started = time.perf_counter()
    for block in cli.blocks:

        def emit(section: dict[str, Any], block: str = block) -> None:
            result["blocks"][block] = section
            write_json(cli.out, result)

        emit(bench_block(block, cli, emit))
    result["wall_s"] = time.perf_counter() - started
    write_json(cli.out, result)
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'block':12s} {'impl':16s} {'ms':>9s} {'fwd ms':>8s} {'tok/s':>10s} {'TFLOP/s':>8s} {'MiB':>8s} "
          f"{'vs HF dflt':>10s} {'max err':>9s} {'rel err':>8s}")  # fmt: skip
    for block, section in result["blocks"].items():
        default = f"speedup_vs_hf_{section['hf_default']}"
        for r in section["rows"]:
            if "ms" not in r:
                print(f"{block:12s} {r['impl']:16s}  {r.get('skipped') or r.get('error')}")
                continue
            peak = r["peak_extra_mib"] if r["peak_extra_mib"] is not None else float("nan")
            err = r["errors"]["out"]
            print(f"{block:12s} {r['impl']:16s} {r['ms']:9.3f} {r['fwd_ms']:8.3f} {r['tokens_per_s']:10.0f} "
                  f"{r['tflops']:8.1f} {peak:8.0f} {r.get(default, float('nan')):10.2f} {err['max_abs']:9.2e} "
                  f"{err['rel']:8.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
