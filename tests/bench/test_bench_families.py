"""Smoke and parity test of tools/bench/bench_families.py on CPU: the gpt-oss, DeepSeek-V3 and Qwen3-VL-MoE blocks, ours vs HF.

``--size tiny`` runs every contender that works on a CPU in fp32 with shared weights and routing, so each must
match the reference (transformers' default experts implementation) to float rounding: a contender fed other
weights, routing or clamp settings would not. The timing fields are only checked for consistency here.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from bench_loader import load_bench

bench = load_bench("bench_families.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("families") / "families.json"
    # The Triton backend is its own test below (on a CPU host it runs in Triton's interpreter: slow).
    returned = bench.main(["--size", "tiny", "--veomni-backends", "torch", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    return result


@pytest.mark.slow  # slow tier: runs a bench script end to end
@pytest.mark.parametrize("block", bench.BLOCKS)
def test_tiny_blocks_match_hf_and_report_every_field(tiny, block):
    section = tiny["blocks"][block]
    rows = {r["impl"]: r for r in section["rows"]}
    default = section["hf_default"]
    assert section["rows"][0]["impl"] == f"hf_{default}"
    assert section["class"] == bench.MODULES[block][2] and section["tokens"] == 24
    ran = [r for r in section["rows"] if "ms" in r]
    assert {"hf_eager", "hf_grouped_mm", "hf_batched_mm", "veomni_torch"} <= {r["impl"] for r in ran}
    for r in ran:
        assert r["reference"] == f"hf_{default}"
        # fp32, same weights and routing: float rounding only (outputs, input grads, every parameter grad).
        assert r["errors"]["out"]["rel"] < 1e-5, (r["impl"], r["errors"])
        assert r["errors"]["d_hidden"]["rel"] < 1e-5, (r["impl"], r["errors"])
        assert r["errors"]["d_params_max_rel"] < 1e-5, (r["impl"], r["errors"])
        assert r["agrees"] is True
        assert r["ms"] > 0 and r["fwd_ms"] > 0 and r["first_call_ms"] > 0 and r["peak_extra_mib"] is None
        assert r["tokens_per_s"] == pytest.approx(24 / (r["ms"] / 1e3))
        assert r["tflops"] == pytest.approx(section["flops_per_step"] / r["ms"] / 1e9)
    ours = rows["veomni_torch"]
    assert ours["experts_implementation"] == "veomni" and ours["ops"]["moe_experts"] == "torch"
    assert rows["hf_eager"]["experts_implementation"] == "eager"
    assert ours[f"speedup_vs_hf_{default}"] == pytest.approx(rows[f"hf_{default}"]["ms"] / ours["ms"])
    assert set(ours["errors"]["d_params_rel"]) == {f"d_{n}" for n in _param_names(block)}
    for impl in ("hf_deepgemm", "hf_sonicmoe"):
        assert "skipped" in rows[impl] or "error" in rows[impl]


def _param_names(block: str) -> list[str]:
    return [n for n, _ in bench.build_hf(block, bench.SHAPES["tiny"][block], "eager").named_parameters()]


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_triton_backend_matches_hf_in_the_interpreter_or_is_skipped(tmp_path):
    args = [
        "--size",
        "tiny",
        "--blocks",
        "gpt_oss",
        "--hf-impls",
        "grouped_mm",
        "--veomni-backends",
        "triton",
    ]
    result = bench.main([*args, "--reps", "1", "--out", str(tmp_path / "t.json")])
    row = {r["impl"]: r for r in result["blocks"]["gpt_oss"]["rows"]}["veomni_triton"]
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert "needs cuda" in row["skipped"]  # a CUDA-only contender on a CPU: skipped with the reason
        return
    assert row["agrees"] is True and row["errors"]["out"]["rel"] < 1e-5, row.get("error") or row["errors"]
    assert row["errors"]["d_params_max_rel"] < 1e-5 and row["ops"]["moe_experts"] == "triton"


@pytest.mark.slow  # slow tier: runs a bench script end to end
def test_a_wrong_veomni_block_is_flagged(tmp_path, monkeypatch):
    # A veomni block clamping at 0.5 instead of gpt-oss's 7.0 must fail the parity check.
    build = bench.build_veomni

    def wrong_limit(block, shape):
        module = build(block, shape)
        module.experts.limit = 0.5
        return module

    monkeypatch.setattr(bench, "build_veomni", wrong_limit)
    args = ["--size", "tiny", "--blocks", "gpt_oss", "--hf-impls", "grouped_mm", "--reps", "1"]
    result = bench.main([*args, "--out", str(tmp_path / "f.json")])
    row = {r["impl"]: r for r in result["blocks"]["gpt_oss"]["rows"]}["veomni_torch"]
    assert row["agrees"] is False and row["errors"]["out"]["rel"] > 1e-2


def test_errors_and_agreement():
    want = {"out": torch.ones(3, 4), "d_hidden": torch.ones(3, 4), "d_w": torch.ones(2, 2)}
    got = {k: v.clone() for k, v in want.items()}
    errs = bench.errors(got, want)
    assert errs["out"] == {"max_abs": 0.0, "rel": 0.0} and bench.agrees(errs, 1e-6)
    got["d_w"][0, 0] = 3.0
    errs = bench.errors(got, want)
    assert errs["d_params_rel"]["d_w"] == pytest.approx(1.0) and not bench.agrees(errs, 1e-2)


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--size", "tiny", "--blocks", "mixtral"])
    assert "mixtral" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--size", "tiny", "--dsv3-experts", "6"])
    cli = bench.parse_args(["--out", "x.json", "--size", "tiny", "--dsv3-experts", "16"])
    assert cli.shapes["deepseek_v3"]["experts"] == 16 and "8 -> 16" in cli.cuts["deepseek_v3"]
    assert bench.SHAPES["full"]["deepseek_v3"]["experts"] == 256  # the table itself is not cut


def test_flops_and_full_shapes_are_the_published_layers():
    gpt = bench.SHAPES["full"]["gpt_oss"]
    assert (gpt["experts"], gpt["top_k"], gpt["hidden"], gpt["inter"]) == (32, 4, 2880, 2880)
    ds = bench.SHAPES["full"]["deepseek_v3"]
    assert (ds["experts"], ds["top_k"], ds["hidden"], ds["inter"], ds["n_group"], ds["topk_group"]) == (
        256, 8, 7168, 2048, 8, 4,
    )  # fmt: skip
    assert bench.flops("gpt_oss", gpt, 10) == 18.0 * 10 * 4 * 2880 * 2880 + 6.0 * 10 * 2880 * 32
    shared = 18.0 * 10 * 7168 * 2048
    assert bench.flops("deepseek_v3", ds, 10) == 18.0 * 10 * 8 * 7168 * 2048 + 6.0 * 10 * 7168 * 256 + shared


@pytest.mark.slow
def test_compiled_contenders_agree_with_eager_ones_and_are_profiled(tmp_path):
    # aot_eager: the compiled rows' wiring (the wrapper, its parameter names, dynamo tracing both blocks) is
    # what this checks; inductor's CPU C++ codegen is not what the bench runs on a GPU, and compiling it twice
    # cost most of this test's minute. The trainer's compiled blocks under inductor are test_bench_e2e's and
    # tests/core/test_compile.py's. --profile writes one op table per contender, compiled ones included.
    args = ["--size", "tiny", "--blocks", "gpt_oss", "--hf-impls", "grouped_mm", "--veomni-backends", "torch"]
    args += ["--compile-backend", "aot_eager", "--profile", str(tmp_path / "prof")]
    result = bench.main([*args, "--compile", "--reps", "1", "--out", str(tmp_path / "c.json")])
    rows = {r["impl"]: r for r in result["blocks"]["gpt_oss"]["rows"]}
    assert list(rows) == ["hf_grouped_mm", "veomni_torch", "hf_grouped_mm_compiled", "veomni_torch_compiled"]
    for name in ("hf_grouped_mm_compiled", "veomni_torch_compiled"):
        assert rows[name]["compiled"] == "torch.compile(block), aot_eager, dynamic=False"
        # Parameter names without torch.compile's "_orig_mod." prefix, so every gradient is compared.
        assert rows[name]["agrees"] is True and "d_experts.down_proj" in rows[name]["errors"]["d_params_rel"]
    assert result["profile_dir"] == str(tmp_path / "prof")
    written = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert written == sorted(f"gpt_oss-{name}.txt" for name in rows)
    for name, row in rows.items():
        assert row["profile"] == f"gpt_oss-{name}.txt" and "gpu_busy_fraction" not in row  # CUDA only
        table = (tmp_path / "prof" / row["profile"]).read_text()
        # Sorted by self CPU time on a CPU host; ours ran its grouped GEMMs in the profiled steps (HF's compiled
        # fp32 block takes its own mm-loop fallback op, so only the table itself is checked there).
        assert "Self CPU" in table and "aten::" in table, table[:2000]
        if name.startswith("veomni"):
            assert "aten::_grouped_mm" in table, table[:2000]


@pytest.mark.parametrize("broken", ["d_hidden", "d_w", "d_v"])
def test_a_nan_error_anywhere_breaks_agreement(broken):
    # A contender whose input or later parameter gradient is NaN must not be reported as agreeing: Python's max
    # drops a NaN that is not its first argument.
    want = {k: torch.ones(3) for k in ("out", "d_hidden", "d_w", "d_v")}
    got = {k: v.clone() for k, v in want.items()}
    got[broken][0] = float("nan")
    errs = bench.errors(got, want)
    assert not bench.agrees(errs, 1e-2)
    if broken != "d_hidden":
        assert math.isnan(errs["d_params_max_rel"])
