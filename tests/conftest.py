"""Shared fixtures: hardware markers, Triton's CPU interpreter and the long-lived distributed pools."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run through Triton's interpreter. It must be chosen before triton is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
from dist_harness import DistPool, gpu_count
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# CI: reproducible examples, and no shrinking, so a failure reports at once instead of replaying hundreds of
# distributed examples.
settings.register_profile(
    "ci",
    parent=settings.get_profile("default"),
    derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject's marker list: the npu marker mirrors `cuda` for Ascend runners.
    config.addinivalue_line("markers", "npu: needs an Ascend NPU and torch_npu (skipped without them)")


def _npu_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = gpu_count()
    npu = any(item.get_closest_marker("npu") for item in items) and _npu_available()
    for item in items:
        if item.get_closest_marker("npu") and not npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))
        if "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "triton_cpu" in item.keywords and os.environ.get("TRITON_INTERPRET") != "1":
            item.add_marker(
                pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (GPU host)")
            )
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {gpus}"))


class _Pools:
    def __init__(self) -> None:
        self._pools: dict[tuple[int, str], DistPool] = {}

    def get(self, world_size: int, backend: str = "gloo") -> DistPool:
        key = (world_size, backend)
        pool = self._pools.get(key)
        if pool is None or pool.broken:
            pool = DistPool(world_size, backend)
            self._pools[key] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            if not pool.broken:
                pool.close()


@pytest.fixture(scope="session")
def dist_pools():
    """``dist_pools.get(world_size, backend)`` returns a live pool; pools outlive tests and examples."""
    pools = _Pools()
    yield pools
    pools.close()
