"""OpsConfig validation against the hardware, default remapping, registry errors and per-model resolution."""

from __future__ import annotations

import pytest
import torch

from veomni.kernels import (
    DEFAULT_BACKENDS,
    KERNELS,
    Hardware,
    KernelRegistry,
    OpsConfig,
    Requirement,
    op_fields,
    resolve_kernels,
)
from veomni.kernels.config import COMPILED_BLOCK_DEFAULTS, FALLBACK_BACKENDS, FIELD_OPS
from veomni.kernels.hardware import ANYWHERE, TRITON

H100 = Hardware(device_type="cuda", capability=(9, 0))
A100 = Hardware(device_type="cuda", capability=(8, 0))
CPU = Hardware(device_type="cpu")
CPU_INTERPRET = Hardware(device_type="cpu", triton_interpret=True)
NPU = Hardware(device_type="npu")


def _toy_registry() -> KernelRegistry:
    """Every op with eager + triton + a Hopper-only backend + an npu backend that needs torch_npu."""
    reg = KernelRegistry()
    ops = {FIELD_OPS[f] for f in op_fields()}
    for op in sorted(ops):
        for variant in ("a", "b"):
            reg.register(op, variant, "eager", lambda: torch.add, ANYWHERE)
            reg.register(op, variant, "triton", lambda: torch.mul, TRITON)
            reg.register(
                op,
                variant,
                "npu",
                lambda: torch.sub,
                Requirement(device_types=("npu",), packages=("torch_npu",)),
            )
        reg.register(
            op, "a", "hopper", lambda: torch.div, Requirement(device_types=("cuda",), min_capability=(9, 0))
        )
        reg.register(op, "a", "sdpa", lambda: torch.maximum, ANYWHERE)
    return reg


def test_unknown_backend_lists_choices_with_did_you_mean():
    with pytest.raises(
        ValueError, match=r"rms_norm='trition' is not a known backend \(did you mean 'triton'\?\)"
    ):
        OpsConfig(rms_norm="trition", hardware=H100, registry=_toy_registry())
    with pytest.raises(ValueError, match=r"allowed: \['eager', 'hopper', 'npu', 'sdpa', 'triton'\]"):
        OpsConfig(rope="qqq", hardware=H100, registry=_toy_registry())


def test_explicit_backend_the_hardware_cannot_run_is_an_error():
    with pytest.raises(
        ValueError, match=r"cannot run here: .*needs cuda \(or any device with TRITON_INTERPRET=1\)"
    ):
        OpsConfig(swiglu="triton", hardware=CPU, registry=_toy_registry())
    with pytest.raises(ValueError, match=r"needs compute capability >= sm_90; this GPU is cuda \(sm_80\)"):
        OpsConfig(swiglu="hopper", hardware=A100, registry=_toy_registry())
    with pytest.raises(ValueError, match=r"needs the package\(s\) \['torch_npu'\]"):
        OpsConfig(swiglu="npu", hardware=NPU, registry=_toy_registry())
    with pytest.raises(ValueError, match=r"Runnable here: \['eager', 'sdpa'\]"):
        OpsConfig(swiglu="triton", hardware=CPU, registry=_toy_registry())
    with pytest.raises(TypeError, match="must be a backend name"):
        OpsConfig(swiglu=3, hardware=CPU, registry=_toy_registry())  # type: ignore[arg-type]


def test_only_defaulted_fields_are_remapped():
    reg = _toy_registry()
    gpu = OpsConfig(rope="eager", hardware=H100, registry=reg)
    assert gpu.rms_norm == "triton" and gpu.rope == "eager"
    assert "rms_norm" in gpu.defaulted and "rope" not in gpu.defaulted
    # No torch_npu here: the npu default cannot run, so unset fields fall back to the eager reference.
    # (attention falls back to sdpa, which the toy registry runs anywhere).
    npu = OpsConfig(hardware=NPU, registry=reg)
    for field in op_fields():
        if DEFAULT_BACKENDS[field]["npu"] == "npu":
            assert getattr(npu, field) == FALLBACK_BACKENDS.get(field, "eager"), field
    assert npu.attention == "sdpa"
    assert npu.defaulted == frozenset(op_fields())
    # The interpreter makes Triton runnable on CPU, but defaults stay on the fast path for the device.
    cpu = OpsConfig(swiglu="triton", hardware=CPU_INTERPRET, registry=reg)
    assert cpu.swiglu == "triton" and cpu.rms_norm == DEFAULT_BACKENDS["rms_norm"]["cpu"]


def test_every_field_has_a_default_row_that_is_registered():
    assert set(DEFAULT_BACKENDS) == set(op_fields())
    for field in op_fields():
        row = DEFAULT_BACKENDS[field]
        assert set(row) == {"cuda", "npu", "cpu"}, field
        op = FIELD_OPS[field]
        backends = KERNELS.backends(op)
        assert "eager" in backends, f"{op} has no eager reference"
        for device, backend in row.items():
            assert backend in backends, f"default {backend!r} for {field} on {device} is not registered"


def test_two_models_resolve_different_kernels():
    reg = _toy_registry()
    fast = resolve_kernels(OpsConfig(hardware=H100, registry=reg))
    ref = resolve_kernels(OpsConfig(rms_norm="eager", hardware=H100, registry=reg))
    assert fast.get("rms_norm", "a") is torch.mul and ref.get("rms_norm", "a") is torch.add
    assert fast.get("rope", "a") is ref.get("rope", "a") is torch.mul


def test_missing_variant_and_unknown_names_raise_on_get():
    reg = _toy_registry()
    kernels = resolve_kernels(OpsConfig(rope="hopper", hardware=H100, registry=reg))
    assert kernels.get("rope", "a") is torch.div
    with pytest.raises(KeyError, match=r"OpsConfig.rope='hopper': rope/b has no 'hopper' implementation"):
        kernels.get("rope", "b")
    with pytest.raises(KeyError, match="no kernel rope/zzz"):
        kernels.get("rope", "zzz")
    with pytest.raises(KeyError, match=r"no kernel op 'rmsnorm' \(did you mean 'rms_norm'\?\)"):
        reg.variants("rmsnorm")


def test_registry_refuses_duplicates_and_third_party_backends_need_no_class_edit():
    reg = _toy_registry()
    with pytest.raises(ValueError, match="already registered"):
        reg.register("swiglu", "a", "eager", lambda: torch.add, ANYWHERE)
    for variant in ("a", "b"):
        reg.register("swiglu", variant, "acme", lambda: torch.minimum, ANYWHERE)
    config = OpsConfig(swiglu="acme", hardware=CPU, registry=reg)
    assert resolve_kernels(config).get("swiglu", "b") is torch.minimum


def test_global_config_builds_on_this_machine():
    config = OpsConfig()
    kernels = resolve_kernels(config)
    assert kernels.config is config
    assert config.hardware.device_type in ("cpu", "cuda")


def test_two_models_in_one_process_keep_their_own_kernels():
    # Real registrations: one model on the eager reference, another on torch's native RMSNorm.
    model_a = resolve_kernels(OpsConfig(rms_norm="eager"))
    model_b = resolve_kernels(OpsConfig(rms_norm="torch"))
    fn_a, fn_b = model_a.get("rms_norm", "standard"), model_b.get("rms_norm", "standard")
    assert fn_a is not fn_b
    assert fn_a.__module__.endswith("rms_norm.eager") and fn_b.__module__.endswith("rms_norm.torch_native")
    x, w = torch.randn(4, 16), torch.randn(16)
    torch.testing.assert_close(fn_a(x, w, 1e-6), fn_b(x, w, 1e-6))
    with pytest.raises(KeyError, match="no kernel op 'rmsnorm'"):
        KERNELS.backends("rmsnorm")


def test_fp32_compute_swaps_only_a_defaulted_half_precision_attention():
    reg = KernelRegistry()
    for op in {FIELD_OPS[f] for f in op_fields()}:
        reg.register(op, "default", "eager", lambda: torch.add, ANYWHERE)
    for backend in ("sdpa", "varlen"):
        reg.register("attention", "default", backend, lambda: torch.mul, Requirement(device_types=("cuda",)))
    ops = OpsConfig(hardware=H100, registry=reg)
    assert ops.attention == DEFAULT_BACKENDS["attention"]["cuda"] == "varlen"
    assert ops.for_compute_dtype(torch.bfloat16) is ops and ops.for_compute_dtype(torch.float16) is ops
    fp32 = ops.for_compute_dtype(torch.float32)
    assert fp32.attention == "sdpa" and fp32.defaulted == ops.defaulted
    assert fp32.rms_norm == ops.rms_norm and fp32.compile == ops.compile
    chosen = OpsConfig(attention="varlen", hardware=H100, registry=reg)
    assert chosen.for_compute_dtype(torch.float32) is chosen  # an explicit choice is the user's
    # Without a varlen kernel (an older torch), the default is sdpa rather than the eager reference.
    no_varlen = KernelRegistry()
    for op in {FIELD_OPS[f] for f in op_fields()}:
        no_varlen.register(op, "default", "eager", lambda: torch.add, ANYWHERE)
    no_varlen.register("attention", "default", "sdpa", lambda: torch.mul, ANYWHERE)
    no_varlen.register(
        "attention",
        "default",
        "varlen",
        lambda: torch.mul,
        Requirement(device_types=("cuda",), packages=("no_such_pkg",)),
    )
    assert OpsConfig(hardware=H100, registry=no_varlen).attention == "sdpa"


def test_a_defaulted_attention_lacking_a_needed_feature_is_swapped_an_explicit_one_refused():
    reg = KernelRegistry()
    for op in {FIELD_OPS[f] for f in op_fields()}:
        reg.register(
            op, "default", "eager", lambda: torch.add, ANYWHERE, capabilities={"sinks", "sliding_window"}
        )
    cuda = Requirement(device_types=("cuda",))
    reg.register("attention", "default", "varlen", lambda: torch.mul, cuda, capabilities={"sliding_window"})
    reg.register(
        "attention", "default", "sdpa", lambda: torch.mul, cuda, capabilities={"sinks", "sliding_window"}
    )
    ops = OpsConfig(hardware=H100, registry=reg)
    assert ops.attention == "varlen"
    assert ops.with_capabilities("attention", {"sliding_window"}, "a windowed model") is ops
    capable = ops.with_capabilities("attention", {"sinks", "sliding_window"}, "gpt_oss")
    assert capable.attention == "sdpa" and capable.defaulted == ops.defaulted
    # Without a capable fallback, the first capable runnable backend in registry order.
    no_sdpa = KernelRegistry()
    for spec in reg.specs():
        if spec.backend != "sdpa":
            no_sdpa.register(spec.op, spec.variant, spec.backend, spec.factory, spec.requires, spec.description,
                             spec.capabilities)  # fmt: skip
    assert OpsConfig(hardware=H100, registry=no_sdpa).with_capabilities(
        "attention", {"sinks"}, "x"
    ).attention == ("eager")
    chosen = OpsConfig(attention="varlen", hardware=H100, registry=reg)
    with pytest.raises(
        ValueError, match=r"gpt_oss needs \['sinks'\].*set to 'varlen'.*runnable here: \['eager', 'sdpa'\]"
    ):
        chosen.with_capabilities("attention", {"sinks"}, "gpt_oss")


def test_compiled_blocks_take_the_eager_formulas_of_defaulted_elementwise_ops_only():
    reg = KernelRegistry()
    for op in {FIELD_OPS[f] for f in op_fields()}:
        reg.register(op, "default", "eager", lambda: torch.add, ANYWHERE)
        reg.register(op, "default", "triton", lambda: torch.mul, Requirement(device_types=("cuda",)))
    reg.register("attention", "default", "varlen", lambda: torch.mul, Requirement(device_types=("cuda",)))
    ops = OpsConfig(hardware=H100, registry=reg)
    assert (ops.rms_norm, ops.rope, ops.swiglu, ops.cross_entropy) == ("triton",) * 4
    compiled = ops.for_compiled_blocks()
    assert set(COMPILED_BLOCK_DEFAULTS) == {"rms_norm", "rope", "rope_vision", "swiglu"}
    assert (compiled.rms_norm, compiled.rope, compiled.rope_vision, compiled.swiglu) == ("eager",) * 4
    # Ops outside the blocks' fusion (the LM head's fused CE, the experts' grouped GEMM) keep their kernels.
    assert (compiled.cross_entropy, compiled.moe_experts, compiled.attention) == (
        "triton",
        "triton",
        "varlen",
    )
    assert compiled.defaulted == ops.defaulted and compiled.compile == ops.compile
    chosen = OpsConfig(rms_norm="triton", hardware=H100, registry=reg).for_compiled_blocks()
    assert (chosen.rms_norm, chosen.rope) == ("triton", "eager")  # an explicit choice is the user's
    everything_set = OpsConfig(
        rms_norm="triton", rope="triton", rope_vision="triton", swiglu="triton", hardware=H100, registry=reg
    )
    assert everything_set.for_compiled_blocks() is everything_set


def test_flash_attn_4_needs_its_cute_subpackage_not_any_flash_attn(tmp_path, monkeypatch):
    # A FlashAttention 2 install (flash_attn without cute) must not make flash_attn_4 look runnable: refused at
    # config time, as the attention entry itself would refuse it at its first call.
    import importlib

    from veomni.kernels import Hardware

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(ValueError, match=r"flash_attn_4.*flash-attn-4.*'flash_attn.cute' not found"):
        OpsConfig(attention="flash_attn_4", hardware=Hardware(device_type="cuda", capability=(9, 0)))
    (tmp_path / "flash_attn" / "cute").mkdir()
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert OpsConfig(
        attention="flash_attn_4", hardware=Hardware(device_type="cuda", capability=(9, 0))
    ).attention == ("flash_attn_4")


def test_flash_attn_2_needs_its_interface_not_the_namespace_flash_attn_4_installs(tmp_path, monkeypatch):
    # flash-attn-4's wheel installs flash_attn/cute/ with no flash_attn/__init__.py: `flash_attn` then imports as a
    # namespace package, which made flash_attn_2 look runnable (every FA2 GPU test failed on an H200 with FA4 alone).
    import importlib

    from veomni.kernels import Hardware
    from veomni.kernels.attention import available_attention_functions

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    h100 = Hardware(device_type="cuda", capability=(9, 0))
    with pytest.raises(ValueError, match=r"flash_attn_2.*flash-attn.*'flash_attn.flash_attn_interface' not found"):
        OpsConfig(attention="flash_attn_2", hardware=h100)
    assert "flash_attn.flash_attn_interface" in available_attention_functions()["flash_attn_2"]
    assert OpsConfig(attention="flash_attn_4", hardware=h100).attention == "flash_attn_4"
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "flash_attn_interface.py").write_text("")
    importlib.invalidate_caches()
    assert OpsConfig(attention="flash_attn_2", hardware=h100).attention == "flash_attn_2"


def test_model_specific_kernels_are_imported_when_a_model_first_takes_them():
    # On a CUDA host with flash-linear-attention installed, the gated-DeltaNet ops default to "fla": building every
    # model's kernel set imported fla (seconds, and transformers with it), and an fla that fails to import crashed a
    # Llama build that never calls those ops. They are built on first `get`, and a failure names the field.
    reg = _toy_registry()
    built: list[str] = []

    def broken() -> object:
        built.append("fla")
        raise ImportError("fla: cannot import name 'something' from 'triton'")

    for op in ("gated_delta_rule", "causal_conv1d", "rms_norm_gated"):
        for variant in ("a", "b"):
            reg.register(op, variant, "fla", broken, Requirement(device_types=("cuda",)))
    config = OpsConfig(hardware=H100, registry=reg)
    assert config.gated_delta_rule == "fla" and "gated_delta_rule" in config.defaulted
    kernels = resolve_kernels(config)
    assert built == []
    assert kernels.get("rms_norm", "a") is torch.mul
    with pytest.raises(
        ImportError, match=r"OpsConfig.gated_delta_rule='fla'.*gated_delta_rule/a.*cannot import"
    ):
        kernels.get("gated_delta_rule", "a")
    assert built == ["fla"]
    explicit = resolve_kernels(OpsConfig(rms_norm_gated="triton", hardware=H100, registry=reg))
    assert explicit.get("rms_norm_gated", "a") is explicit.get("rms_norm_gated", "a") is torch.mul


def _fake_liger(root, version: str) -> None:
    # Only what the probe reads: the package and its distribution metadata (nothing is imported).
    (root / "liger_kernel").mkdir()
    (root / "liger_kernel" / "__init__.py").write_text("")
    info = root / f"liger_kernel-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: liger-kernel\nVersion: {version}\n")


@pytest.mark.parametrize("version, runs", [("0.8.4", False), ("0.6.0", False), ("0.8.5", True), ("0.9.0rc1", True)])
def test_liger_rope_needs_a_release_that_takes_rotary_dim(tmp_path, monkeypatch, version, runs):
    # veomni's liger rope passes rotary_dim (partial RoPE), a LigerRopeFunction argument since liger-kernel 0.8.5:
    # an older liger raised a TypeError at the model's first forward instead of being refused with the config.
    import importlib

    _fake_liger(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert OpsConfig(rms_norm="liger", swiglu="liger", hardware=H100).rms_norm == "liger"
    if runs:
        assert OpsConfig(rope="liger", hardware=H100).rope == "liger"
    else:
        with pytest.raises(ValueError, match=rf"rope='liger' cannot run.*>= 0\.8\.5.*liger-kernel {version} is installed"):
            OpsConfig(rope="liger", hardware=H100)


@pytest.mark.parametrize("version, runs", [("0.6.1", False), ("0.6.2", True), ("0.6.5", True)])
def test_quack_needs_a_release_with_the_rmsnorm_weight_offset(tmp_path, monkeypatch, version, runs):
    # quack_backend's offset RMSNorm passes weight_offset to quack.rmsnorm, which quack-kernels has taken since
    # 0.6.2: on 0.6.0 / 0.6.1 (allowed by the [quack] extra) a Qwen3-Next run raised a TypeError at its first forward.
    import importlib

    (tmp_path / "quack").mkdir()
    (tmp_path / "quack" / "__init__.py").write_text("")
    info = tmp_path / f"quack_kernels-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: quack-kernels\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    if runs:
        assert OpsConfig(rms_norm="quack", hardware=H100).rms_norm == "quack"
    else:
        with pytest.raises(ValueError, match=rf"rms_norm='quack' cannot run.*>= 0\.6\.2.*quack-kernels {version}"):
            OpsConfig(rms_norm="quack", hardware=H100)
