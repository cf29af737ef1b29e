"""The pieces of a Wan2.1-T2V-1.3B attention layer that `veomni.models.wan.kernels` replaces, timed side by side:
diffusers' own code against veomni's kernels, eager and under ``torch.compile``, on the shapes of one 480x832x81
sample (32,760 tokens, 12 heads x 128, bf16), forward + backward, JSON out.

    python3 tools/bench/bench_wan_ops.py --out wan_ops.json [--tokens 32760] [--reps 10]
    python3 tools/bench/bench_wan_ops.py --out /tmp/w.json --device cpu --tokens 64 --heads 2 --dtype fp32 \
        --no-compile   # CPU smoke (tests/bench/test_bench_wan_ops.py)

Rows (each: median fwd+bwd ms, median forward ms, peak extra MiB, max |error| of output against diffusers'):

- ``rotary``: diffusers' formula (float64 tables, as ``WanAttnProcessor`` runs it) / ``rope/interleaved`` triton /
  diffusers' formula under ``torch.compile`` (what compiled blocks run), on q and k ``[1, S, 12, 128]``;
- ``qk_norm``: ``torch.nn.RMSNorm(1536)`` (diffusers' ``norm_q``) / ``rms_norm/standard`` triton / the module
  compiled, on q and k ``[1, S, 1536]``;
- ``self_attention``: a whole ``WanAttention`` (projections, norms, rotary, attention, output projection) with
  diffusers' ``WanAttnProcessor`` / veomni's ``WanKernelAttnProcessor`` with the device defaults (varlen attention on
  CUDA) / each of those compiled (veomni's with the eager formulas of ``COMPILED_BLOCK_DEFAULTS``).

A failing row (a missing kernel, out of memory) is recorded with its error; the JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import environment, error_text, max_abs, release, timed_row, write_json  # noqa: E402

from veomni.kernels import OpsConfig, resolve_kernels  # noqa: E402
from veomni.kernels.hardware import Hardware, detect_hardware  # noqa: E402
from veomni.models.wan.kernels import WanKernelAttnProcessor, diffusers_rotary, wan_ops  # noqa: E402


def _ops(device: torch.device, compiled: bool) -> OpsConfig:
    hw = detect_hardware()
    if hw.device_type != device.type:
        hw = Hardware(device_type=device.type, triton_interpret=hw.triton_interpret)
    ops = OpsConfig(compile="off", hardware=hw)
    return ops.for_compiled_blocks() if compiled else ops


def _row(
    fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], want: torch.Tensor | None, device: torch.device,
    reps: int,
) -> dict[str, Any]:  # fmt: skip
    probe = torch.randn_like(fn(), dtype=torch.float32)

    def step() -> torch.Tensor:
        for leaf in leaves:
            leaf.grad = None
        out = fn()
        (out.float() * probe).sum().backward()
        return out

    out = step()
    row = timed_row(step, fn, device, reps)
    row["max_abs_vs_diffusers"] = None if want is None else max_abs(out.detach(), want)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every row; returns the JSON object (also written to ``args.out``)."""
    from diffusers.models.transformers.transformer_wan import (
        WanAttention,
        WanAttnProcessor,
        WanRotaryPosEmbed,
    )

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    heads, head_dim, s = args.heads, 128, args.tokens
    width = heads * head_dim
    g = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"env": environment(device), "settings": vars(args), "rows": {}}
    rows = result["rows"]
    # Wan's rotary tables for a latent of `tokens` positions (1 x 1 x S grid is enough for the maths' cost).
    rope = WanRotaryPosEmbed(head_dim, (1, 1, 1), max(1024, s)).to(device)
    cos, sin = (t[:, :s] for t in rope(torch.zeros(1, 1, 1, 1, s, device=device)))
    q = torch.randn(1, s, heads, head_dim, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, s, heads, head_dim, generator=g).to(device, dtype).requires_grad_()
    kernels = resolve_kernels(_ops(device, compiled=False))
    ours = wan_ops(kernels)

    def theirs_rotary() -> torch.Tensor:
        return torch.cat([diffusers_rotary(q, cos, sin), diffusers_rotary(k, cos, sin)])

    compiled_rotary = torch.compile(theirs_rotary)
    want = theirs_rotary().detach()
    cases: list[tuple[str, str, Callable[[], torch.Tensor], list[torch.Tensor]]] = [
        ("rotary", "diffusers", theirs_rotary, [q, k]),
        ("rotary", f"veomni_{ours.names['rope']}", lambda: torch.cat(ours.rope(q, k, cos, sin)) if ours.rope
         else theirs_rotary(), [q, k]),
    ]  # fmt: skip
    if args.compile:
        cases.append(("rotary", "diffusers_compiled", compiled_rotary, [q, k]))
    norm = torch.nn.RMSNorm(width, eps=1e-6).to(device, dtype)
    x = torch.randn(2, s, width, generator=g).to(device, dtype).requires_grad_()
    compiled_norm = torch.compile(norm)
    norm_want = norm(x).detach()
    cases += [
        ("qk_norm", "diffusers", lambda: norm(x), [x, norm.weight]),
        ("qk_norm", f"veomni_{ours.names['rms_norm']}", lambda: ours.rms_norm(x, norm.weight, norm.eps)
         if ours.rms_norm else norm(x), [x, norm.weight]),
    ]  # fmt: skip
    if args.compile:
        cases.append(("qk_norm", "diffusers_compiled", lambda: compiled_norm(x), [x, norm.weight]))
    attn = WanAttention(dim=width, heads=heads, dim_head=head_dim, eps=1e-6).to(device, dtype)
    h = torch.randn(1, s, width, generator=g).to(device, dtype).requires_grad_()
    leaves = [h, *attn.parameters()]
    processors = {
        "diffusers": WanAttnProcessor(),
        f"veomni_{ours.names['attention']}": WanKernelAttnProcessor(ours),
    }

    def layer(processor: Callable[..., torch.Tensor], compiled: bool) -> Callable[[], torch.Tensor]:
        # The processor called directly (as WanAttention.forward does): no set_processor inside compiled code.
        def forward() -> torch.Tensor:
            return processor(attn, h, None, None, (cos, sin))

        return torch.compile(forward) if compiled else forward

    attn_want = None
    for name, processor in processors.items():
        cases.append(("self_attention", name, layer(processor, False), leaves))
    if args.compile:
        compiled_ours = WanKernelAttnProcessor(wan_ops(resolve_kernels(_ops(device, compiled=True))))
        cases.append(("self_attention", "diffusers_compiled", layer(processors["diffusers"], True), leaves))
        cases.append(("self_attention", "veomni_compiled", layer(compiled_ours, True), leaves))
    for op, name, fn, case_leaves in cases:
        reference = {"rotary": want, "qk_norm": norm_want}.get(op, attn_want)
        try:
            row = _row(fn, case_leaves, reference, device, args.reps)
        except Exception as err:  # noqa: BLE001 - a failing row is a result to report
            row = {"error": error_text(err)}
        if op == "self_attention" and name == "diffusers" and "error" not in row:
            with torch.no_grad():
                attn_want = fn().detach()
        rows[f"{op}/{name}"] = row
        print(f"{op:15s} {name:22s} {row.get('ms', row.get('error'))}", file=sys.stderr, flush=True)
        write_json(args.out, result)
        release(device)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the command line and run."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=32760, help="sequence length (480x832x81 latents: 32,760)")
    p.add_argument("--heads", type=int, default=12, help="attention heads of 128 (Wan2.1-1.3B: 12)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="the compiled rows")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
