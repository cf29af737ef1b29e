"""Ascend NPU selection rules on a fake ``Hardware(device_type="npu")`` (no NPU here): the NPU defaults, the
reference's rule that GPU backends are rejected on NPU (listing the allowed ones), the loud default fallback, and
the walk over every OpsConfig field."""

from __future__ import annotations

import logging

import attrs
import pytest

from veomni.kernels import DEFAULT_BACKENDS, KERNELS, Hardware, KernelRegistry, OpsConfig, op_fields
from veomni.kernels.config import FIELD_OPS, npu_backends

NPU = Hardware(device_type="npu")
CPU = Hardware(device_type="cpu")


def _registry_with_torch_npu() -> KernelRegistry:
    """The real registry as an NPU host with torch_npu installed sees it: npu specs need no missing package."""
    reg = KernelRegistry()
    for s in KERNELS.specs():
        requires = s.requires
        if s.backend == "npu":
            requires = attrs.evolve(requires, packages=())
        reg.register(s.op, s.variant, s.backend, s.factory, requires, s.description, s.capabilities)
    return reg


def test_every_field_has_an_npu_capable_default():
    # The reference's coverage assertion: no op can bypass the NPU table.
    for field in op_fields():
        default = DEFAULT_BACKENDS[field]["npu"]
        assert default in npu_backends(field), (field, default, npu_backends(field))
        assert "eager" in npu_backends(field), field


def test_npu_allow_lists_exclude_every_gpu_backend():
    assert npu_backends("rms_norm") == ["eager", "npu", "torch"]
    assert npu_backends("attention") == ["eager", "npu", "sdpa"]
    assert npu_backends("cross_entropy") == ["chunk_loss", "eager"]
    assert npu_backends("log_probs") == ["chunked", "eager"]
    assert npu_backends("swiglu") == ["eager"]
    assert npu_backends("moe_experts") == ["eager", "npu"]
    assert npu_backends("rope_vision") == npu_backends("rope") == ["eager", "npu"]
    for field in op_fields():
        for backend in ("triton", "liger", "varlen", "flex", "flash_attn_2"):
            assert backend not in npu_backends(field)


def test_npu_host_with_torch_npu_selects_npu_kernels():
    ops = OpsConfig(hardware=NPU, registry=_registry_with_torch_npu())
    chosen = {field: getattr(ops, field) for field in op_fields()}
    assert chosen == {
        "attention": "npu",
        "cross_entropy": "chunk_loss",
        "rms_norm": "npu",
        "rope": "npu",
        "rope_vision": "npu",
        "swiglu": "eager",
        "moe_experts": "npu",
        "load_balancing_loss": "eager",
        # Gated DeltaNet ops: fla is CUDA-only, so NPU pins the eager oracles.
        "gated_delta_rule": "eager",
        "causal_conv1d": "eager",
        "rms_norm_gated": "eager",
        "log_probs": "chunked",
    }
    assert ops.defaulted == frozenset(op_fields())
    assert not ops.compile_enabled  # "auto" compiles on CUDA only
    # The NPU attention computes no optional feature: a sinks model is refused with the backends that have it.
    with pytest.raises(ValueError, match=r"needs \['sinks'\].*lacks \['sinks'\]"):
        ops.require_capabilities("attention", {"sinks"}, "gpt_oss")


@pytest.mark.parametrize(
    ("field", "gpu_backend", "allowed"),
    [
        ("rms_norm", "triton", "['eager', 'npu', 'torch']"),
        ("rope", "liger", "['eager', 'npu']"),
        ("attention", "varlen", "['eager', 'npu', 'sdpa']"),
        ("cross_entropy", "triton", "['chunk_loss', 'eager']"),
        ("swiglu", "triton", "['eager']"),
        ("moe_experts", "triton", "['eager', 'npu']"),
        ("load_balancing_loss", "triton", "['eager']"),
        ("log_probs", "triton", "['chunked', 'eager']"),
    ],
)
def test_gpu_backends_are_rejected_on_npu_listing_the_allowed(field, gpu_backend, allowed):
    for registry in (KERNELS, _registry_with_torch_npu()):
        with pytest.raises(ValueError, match="rejected on an Ascend NPU") as err:
            OpsConfig(hardware=NPU, registry=registry, **{field: gpu_backend})
        assert f"OpsConfig.{field}={gpu_backend!r} is a GPU backend" in str(err.value)
        assert f"allowed on npu: {allowed}" in str(err.value)


def test_npu_backend_without_torch_npu_or_off_npu_is_an_error():
    with pytest.raises(
        ValueError, match=r"rms_norm='npu' cannot run here: .*needs the package\(s\) \['torch_npu'\]"
    ):
        OpsConfig(hardware=NPU, rms_norm="npu")
    with pytest.raises(
        ValueError, match=r"attention='npu' cannot run here: .*needs npu; this process has cpu"
    ):
        OpsConfig(hardware=CPU, attention="npu")


def test_npu_default_that_cannot_run_falls_back_loudly(caplog):
    # An NPU process without torch_npu (cannot happen on a real Ascend host, where torch.npu comes from torch_npu):
    # the npu defaults fall back, and each fallback is a warning naming the reason and the choice.
    with caplog.at_level(logging.WARNING, logger="veomni.kernels.config"):
        ops = OpsConfig(hardware=NPU)
    assert ops.attention == "sdpa" and ops.rms_norm == "eager" and ops.moe_experts == "eager"
    assert ops.cross_entropy == "chunk_loss"  # portable: runs without torch_npu
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "OpsConfig.rms_norm: the npu default 'npu' cannot run" in m and "torch_npu" in m for m in messages
    )
    assert len(messages) == sum(DEFAULT_BACKENDS[f]["npu"] == "npu" for f in op_fields())


def test_every_npu_registration_is_a_real_kernel_module():
    # Every npu spec names a function in veomni.kernels.npu_backend (no declared-only placeholders remain).
    specs = [s for s in KERNELS.specs() if s.backend == "npu"]
    assert {(s.op, s.variant) for s in specs} == {
        ("attention", "default"), ("moe_experts", "grouped"), ("moe_experts", "routed"), ("rms_norm", "offset"),
        ("rms_norm", "residual"), ("rms_norm", "standard"), ("rms_norm", "unweighted"), ("rope", "full"),
        ("rope", "partial"), ("rope", "mrope"), ("rope_vision", "full"),
    }  # fmt: skip
    for s in specs:
        assert s.description.startswith("veomni.kernels.npu_backend:"), s
        assert s.requires.packages == ("torch_npu",) and s.requires.device_types == ("npu",)
    assert {FIELD_OPS[f] for f in op_fields()} <= set(KERNELS.ops())
