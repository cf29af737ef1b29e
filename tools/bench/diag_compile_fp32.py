"""Diagnostic: why compiled decoder blocks differ from eager ones in fp32 on CUDA (the 2026-11-25 finding).

One tiny Qwen3 (the trainer grid's dense model: V 1024, H 64, 2 layers), fp32, on one packed row of three
documents; the same weights built eagerly and with compiled blocks under several settings. For each setting: the
relative difference of the loss and of every parameter gradient from the eager build. A setting that brings the
difference to float rounding (~1e-6) names the cause. Writes JSON with ``--out``.

    python3 tools/bench/diag_compile_fp32.py --out diag.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Qwen3Config

from veomni.core.compile import compile_blocks
from veomni.kernels import OpsConfig
from veomni.models.build import build_model

BLOCKS = ("model.layers.*",)


def _config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip


def _batch(device: str, lens: tuple[int, ...]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (1, sum(lens)), generator=gen).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {
        "input_ids": ids, "labels": ids.clone(), "shift_labels": ids.roll(-1, 1),
        "position_ids": torch.cat([torch.arange(n) for n in lens])[None].to(device), "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu, "max_length_q": max(lens), "max_length_k": max(lens), "use_cache": False,
    }  # fmt: skip


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _setting(name: str) -> Iterator[None]:
    import torch._inductor.config as inductor

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    patches: dict[str, Any] = {}
    if name == "no_tf32_anywhere":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    elif name == "no_pattern_matcher":
        patches = {"pattern_matcher": False}
    elif name == "emulate_precision_casts":
        patches = {"emulate_precision_casts": True}
    elif name == "no_fusion":
        patches = {"max_fusion_size": 1}
    with inductor.patch(patches) if patches else contextlib.nullcontext():
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = _config()
    attentions = ("sdpa", "eager")
    results: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "rows": []}
    for attention in attentions:
        ops = OpsConfig(attention=attention, compile="off")
        torch.manual_seed(0)
        eager = build_model(config, ops=ops, device=args.device)
        state = eager.state_dict()
        for lens in ((100, 60, 96), (256,)):
            batch = _batch(args.device, lens)
            want_loss, want_grads = _loss_and_grads(eager, batch)
            for backend, setting in [("aot_eager", "default"), ("inductor", "default"), ("inductor", "no_tf32_anywhere"),
                                     ("inductor", "no_pattern_matcher"), ("inductor", "emulate_precision_casts"),
                                     ("inductor", "no_fusion")]:  # fmt: skip
                torch._dynamo.reset()
                with _setting(setting):
                    model = build_model(config, ops=ops, device=args.device)
                    model.load_state_dict(state)
                    compile_blocks(model, BLOCKS, backend=backend)
                    if backend == "aot_eager" and attention == attentions[0] and len(lens) > 1:
                        # As the trainer builds it: compile "on" (its defaulted kernels become the eager formulas
                        # inductor fuses), against an eager build of those same formulas.
                        trainer_like = build_model(config, ops=ops.with_compile("on"), device=args.device)
                        trainer_like.load_state_dict(state)
                        formulas = build_model(config, ops=ops.for_compiled_blocks(), device=args.device)
                        formulas.load_state_dict(state)
                        ref_loss, ref_grads = _loss_and_grads(formulas, batch)
                        got_loss, got_grads = _loss_and_grads(trainer_like, batch)
                        row = {"attention": attention, "lens": lens, "backend": "build_model(compile=on)",
                               "setting": "vs eager formulas", "loss_rel_diff": abs(got_loss - ref_loss) / abs(ref_loss),
                               "worst_grad_rel_diff": max(float((got_grads[n] - g).norm() / g.norm().clamp(min=1e-30))
                                                          for n, g in ref_grads.items())}  # fmt: skip
                        results["rows"].append(row)
                        print(json.dumps(row), flush=True)
                    try:
                        loss, grads = _loss_and_grads(model, batch)
                    except Exception as err:  # noqa: BLE001 - a failing setting is a result
                        results["rows"].append({"attention": attention, "lens": lens, "backend": backend,
                                                "setting": setting, "error": repr(err)[:300]})  # fmt: skip
                        continue
                worst = max(
                    float((grads[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in want_grads.items()
                )
                row = {"attention": attention, "lens": lens, "backend": backend, "setting": setting,
                       "loss_rel_diff": abs(loss - want_loss) / abs(want_loss), "worst_grad_rel_diff": worst}  # fmt: skip
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
