"""veomni.core: meshes, Ulysses SP and EP collectives, FSDP2 application, cross-mesh clipping, loss maths.

Depends on torch and attrs only. Import the submodules directly; this file re-exports the common entry points.
"""

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import (
    ParallelState,
    build_parallel_state,
    current_parallel_state,
    use_parallel_state,
)

__all__ = [
    "ParallelDims",
    "ParallelState",
    "build_parallel_state",
    "current_parallel_state",
    "use_parallel_state",
]
