"""When flash-linear-attention's gated delta rule may be selected: a `Requirement.condition` (no fla import;
Triton's own version is read from the module).

fla 0.6's gated chunk backward (``chunk_bwd_dqkwg``) computes wrong gradients on Hopper GPUs with Triton >= 3.4.0 and
< 3.7.1 (fla issue #640); fla itself raises at the first *backward*, i.e. after a model is built, loaded and has run
a forward. Checking the same condition when the `OpsConfig` is resolved turns that into a build-time choice: the
default falls back to ``eager`` with a warning, an explicit ``gated_delta_rule: fla`` is refused naming the fix.
"""

from __future__ import annotations

import importlib.util
import re

from veomni.kernels.hardware import Hardware

__all__ = ["fla_gated_delta_problem"]

_BROKEN_TRITON = ((3, 4, 0), (3, 7, 1))


def _release(version: str) -> tuple[int, int, int] | None:
    # "3.6.0", "3.7.1+git1234", "3.8.0rc1": the numeric release; None when it does not start with one.
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def fla_gated_delta_problem(hw: Hardware) -> str | None:
    """Why fla's gated delta rule must not train on ``hw`` with the installed Triton, or None.

    Only Hopper (sm_90) with Triton in [3.4.0, 3.7.1) and no tilelang (fla's alternative backend) is refused.
    """
    if hw.device_type != "cuda" or hw.capability is None or hw.capability[0] != 9:
        return None
    try:
        # The module that will be imported (as fla reads it), not the distribution metadata: a Triton put first on
        # the path (PYTHONPATH) can differ from the installed distribution's version.
        import triton

        installed = triton.__version__
    except ImportError:
        return None  # without triton, fla does not import: its package requirement reports that
    release = _release(installed)
    low, high = _BROKEN_TRITON
    if release is None or not low <= release < high or importlib.util.find_spec("tilelang") is not None:
        return None
    return (
        f"computes wrong gated-delta-rule gradients on Hopper with triton {installed} (fla issue #640: triton >= "
        f"{_dotted(low)} and < {_dotted(high)}); upgrade triton to >= {_dotted(high)}, install tilelang, or use "
        "gated_delta_rule: eager"
    )
