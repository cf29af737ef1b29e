"""Qwen3-Next-class and Qwen3.5-dense-class layer stacks, one GPU: veomni's adapter (OpsConfig defaults: fla Gated DeltaNet, Triton norms /
RoPE / SwiGLU / grouped-GEMM experts, varlen attention) against plain transformers with its own fast path
(flash-linear-attention installed: HF's Gated DeltaNet calls fla's kernels), same weights, same packed data.

    python3 tools/bench/bench_qwen3_next.py --out qwen3_next.json                       # H100 / H200
    python3 tools/bench/bench_qwen3_next.py --out qwen3_5.json --family qwen3_5 --layers 8    # Qwen3.5-9B shapes
    python3 tools/bench/bench_qwen3_next.py --out s.json --tiny --device cpu --tokens 64 --reps 1   # CPU smoke

Model: Qwen3-Next-80B-A3B's layer shapes (hidden 2048; Gated DeltaNet 16 key / 32 value heads of 128, conv 4;
gated attention 16 q / 2 kv heads of 256, partial RoPE 0.25; routed experts of width 512 top-10 + a shared
expert of 512), cut to ``--layers`` (default 8: 6 linear + 2 full attention) and ``--experts`` (default 64 of
512, so that one GPU holds it). ``--family qwen3_5``: Qwen3.5-9B's text model (transformers' Qwen3_5TextConfig
defaults: hidden 4096, Gated DeltaNet 16 key / 32 value heads of 128, gated attention 16 q / 4 kv heads of 256,
dense SwiGLU MLP of 12,288, vocabulary 248,320), cut to ``--layers`` the same way. bf16 parameters for both contenders (a fwd+bwd step, no optimizer: the layers
are what differs). Data: one packed row of ``--tokens`` tokens of documents of random lengths
(`bench_e2e.packed_batches`); both get ``input_ids``, ``position_ids``, ``labels`` and the packing kwargs
(``cu_seq_lens_q/k``, ``max_length_q/k``), which HF forwards to fla as ``cu_seqlens``.

Off CUDA (the ``--tiny`` smoke) fla cannot run, and transformers' wrappers send its Gated DeltaNet to fla whenever
fla is installed; the ``hf`` contender then runs transformers' own torch reference functions instead
(`hf_torch_reference`), which ignore the packing (give the smoke a single document).

Per contender: median fwd+bwd ms, forward ms, tokens/s, peak extra memory, loss; the JSON also has the loss and
logits agreement between the two and the speed-up (target: >= 1.5x tokens/s).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, error_text, rel_err, release, timed_row, write_json  # noqa: E402
from bench_e2e import packed_batches  # noqa: E402

from veomni.kernels import Hardware, OpsConfig, detect_hardware  # noqa: E402
from veomni.models.hf.kernel_hooks import apply_ops  # noqa: E402
from veomni.models.qwen3_5.generated import patched_modeling_qwen3_5 as ours_qwen3_5  # noqa: E402
from veomni.models.qwen3_next.generated import patched_modeling_qwen3_next as ours_qwen3_next  # noqa: E402

# family -> (transformers' modeling module, its causal-LM class name, veomni's generated module)
FAMILIES = {
    "qwen3_next": (hf_qwen3_next, "Qwen3NextForCausalLM", ours_qwen3_next),
    "qwen3_5": (hf_qwen3_5, "Qwen3_5ForCausalLM", ours_qwen3_5),
}


def model_config(args: argparse.Namespace) -> PreTrainedConfig:
    """The benchmark's config: the family's published shapes with the depth (and Qwen3-Next's expert count) cut
    down, or a tiny one."""
    if args.family == "qwen3_5":
        tiny = dict(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16,
        )  # fmt: skip
        # Everything else is Qwen3_5TextConfig's defaults: Qwen3.5-9B's text model.
        return Qwen3_5TextConfig(
            **(tiny if args.tiny else {}), num_hidden_layers=args.layers, full_attention_interval=4,
            tie_word_embeddings=False, max_position_embeddings=65536,
        )  # fmt: skip
    if args.tiny:
        values = dict(
            vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16,
        )  # fmt: skip
    else:
        values = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, num_experts=args.experts, num_experts_per_tok=10,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        )  # fmt: skip
    return Qwen3NextConfig(
        **values, num_hidden_layers=args.layers, full_attention_interval=4, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        output_router_logits=False, tie_word_embeddings=False, max_position_embeddings=65536,
    )  # fmt: skip


def inputs_for(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    cu = batch["cu_seqlens"].to(device)
    return {
        "input_ids": batch["input_ids"].to(device),
        "position_ids": batch["position_ids"].to(device),
        "labels": batch["labels"].to(device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": batch["max_seqlen"],
        "max_length_k": batch["max_seqlen"],
        "use_cache": False,
    }


def contender_row(model: torch.nn.Module, inputs: dict[str, Any], device: torch.device, reps: int) -> dict:
    # packed_batches' labels are already shifted per document; HF's labels path shifts them itself, so both
    # contenders get them moved one position right (the target of token t is then shifted[t], as generated).
    shifted = inputs["labels"]
    labels = torch.cat([torch.full_like(shifted[:, :1], -100), shifted[:, :-1]], dim=1)
    kwargs = {**{k: v for k, v in inputs.items() if k != "labels"}, "labels": labels}

    def step():
        model.zero_grad(set_to_none=True)
        out = model(**kwargs)
        out.loss.backward()
        return out.loss.detach()

    def forward():
        return model(**kwargs).loss

    loss = step()
    row = timed_row(step, forward, device, reps)
    tokens = inputs["input_ids"].numel()
    row["tokens_per_s"] = tokens / (row["ms"] / 1e3)
    row["loss"] = float(loss)
    with torch.no_grad():
        # Without labels: a fused cross-entropy (veomni's CUDA default) never materialises logits when it has them.
        unlabelled = {k: v for k, v in kwargs.items() if k not in ("labels", "shift_labels")}
        row["_logits"] = model(**unlabelled).logits.float().cpu()
    return row


@contextlib.contextmanager
def hf_torch_reference(hf_modeling, device: torch.device):
    """Off CUDA: point transformers' modeling module at its torch functions (the wrappers' ``__wrapped__``)."""
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn")
    saved = {n: getattr(hf_modeling, n) for n in names}
    if device.type != "cuda":
        for name, fn in saved.items():
            setattr(hf_modeling, name, getattr(fn, "__wrapped__", fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(hf_modeling, name, fn)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_next")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64, help="Qwen3-Next's routed experts (of 512)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--min-doc", type=int, default=64, help="shortest document of the packed row")
    parser.add_argument("--max-doc", type=int, default=None, help="longest document (default: tokens / 4)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = model_config(args)
    hf_modeling, hf_class_name, ours_modeling = FAMILIES[args.family]
    hf_class = getattr(hf_modeling, hf_class_name)
    ours_class = getattr(ours_modeling, hf_class_name)
    max_doc = args.max_doc or max(args.min_doc, args.tokens // 4)
    batch = packed_batches(1, args.tokens, config.vocab_size, args.min_doc, max_doc, seed=0)[0]
    inputs = inputs_for(batch, device)
    result: dict[str, Any] = {"env": environment(device), "args": vars(args), "config": config.to_diff_dict()}
    result["documents"] = len(batch["doc_lens"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hf_config = copy.deepcopy(config)
    hf_config._attn_implementation = "sdpa"
    hf = hf_class(hf_config).to(device, dtype)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    del hf
    release(device)
    rows: dict[str, Any] = {}
    for name in ("veomni", "hf"):  # veomni first: an HF OOM cannot cost its result
        try:
            if name == "veomni":
                model = ours_class(copy.deepcopy(config)).to(device, dtype)
                model.load_state_dict(state)
                # Defaults for the device the step runs on (a CPU smoke on a GPU host gets the CPU defaults).
                hardware = detect_hardware() if device.type == "cuda" else Hardware(device_type=device.type)
                ops = OpsConfig(compile="off", hardware=hardware)
                apply_ops(model, ops.for_compute_dtype(dtype))
                result["veomni_ops"] = {f: getattr(ops, f) for f in ("attention", "gated_delta_rule",
                                        "causal_conv1d", "rms_norm_gated", "moe_experts", "rms_norm")}  # fmt: skip
            else:
                model = hf_class(copy.deepcopy(hf_config)).to(device, dtype)
                model.load_state_dict(state)
                result["hf_experts_implementation"] = model.config._experts_implementation
                # Without the causal_conv1d package HF's short convolution is its torch fallback, which drops the
                # packing kwargs: documents of a packed row then convolve across their boundaries (logits differ).
                result["hf_causal_conv1d_package"] = importlib.util.find_spec("causal_conv1d") is not None
            model.train()
            with hf_torch_reference(hf_modeling, device):
                rows[name] = contender_row(model, inputs, device, args.reps)
        except Exception as err:  # a failing contender is a result, not a crash
            rows[name] = {"error": error_text(err)}
        finally:
            model = None
            release(device)
        result["rows"] = {k: {kk: vv for kk, vv in v.items() if kk != "_logits"} for k, v in rows.items()}
        write_json(args.out, result)
    if all("_logits" in rows.get(n, {}) for n in ("veomni", "hf")):
        result["logits_rel_err"] = rel_err(rows["veomni"]["_logits"], rows["hf"]["_logits"])
        result["speedup_tokens_per_s"] = rows["veomni"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    write_json(args.out, result)
    print({k: v for k, v in result.items() if k not in ("env", "config")})
    return result


if __name__ == "__main__":
    main()
