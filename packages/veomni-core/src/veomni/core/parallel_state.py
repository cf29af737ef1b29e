"""Device meshes and process groups for a `ParallelDims` topology, and the context-scoped current state.

`build_parallel_state(dims, device_type)` is the one place meshes are created. Everything else receives the
`ParallelState` (or one of its groups) as an argument. The only ambient value is the context-scoped current
state, set with ``with use_parallel_state(state):``; it exists for code that HF modeling calls without a way to
pass arguments (attention functions, loss functions) and it is never filled in silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Iterator

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from veomni.core.parallel_dims import ParallelDims

MAIN_MESH_DIMS = ("dp_replicate", "dp_shard", "sp")
EP_MESH_DIMS = ("ep_replicate", "ep_fsdp", "ep")


@attrs.frozen(eq=False)
class ParallelState:
    """Meshes of one topology. Build it with `build_parallel_state`; do not construct it directly.

    Attributes:
        dims: the validated degrees.
        device: this rank's device (``cpu`` or ``cuda:<local rank>``).
        mesh: the main mesh ``[dp_replicate, dp_shard, sp]``; the flattened views are separate fields.
        ep_mesh: ``[ep_replicate, ep_fsdp, ep]`` when ``dims.ep > 1``, else None.
    """

    dims: ParallelDims
    device: torch.device
    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    fsdp_shard_mesh: DeviceMesh
    fsdp_mesh: DeviceMesh
    loss_mesh: DeviceMesh
    ep_mesh: DeviceMesh | None
    # Sub-meshes by (parent, dim names). Slicing a DeviceMesh builds a new one each time (a coordinate search and
    # a new object: ~1 ms of host time measured on the CI box), and the hot paths (every MoE dispatch, every
    # Ulysses attention call) ask for their group on each call.
    _submeshes: dict[tuple[str, tuple[str, ...]], DeviceMesh] = attrs.field(
        factory=dict, init=False, repr=False
    )

    # Meshes: the fields above are
    #   dp_mesh          1-D dp_replicate*dp_shard: ranks that read different data (SP peers excluded)
    #   fsdp_shard_mesh  1-D dp_shard*sp: ranks holding different shards of a dense parameter
    #   fsdp_mesh        what `fully_shard` uses: fsdp_shard_mesh, or 2-D [dp_replicate, dp_shard_sp] (HSDP)
    #   loss_mesh        1-D dp*sp, the whole world: token counts, losses and gradient averaging
    @property
    def sp_mesh(self) -> DeviceMesh:
        return self._submesh("main", "sp")

    @property
    def ep_fsdp_mesh(self) -> DeviceMesh:
        """The mesh expert modules are FSDP-sharded on: ``ep_fsdp``, or ``[ep_replicate, ep_fsdp]`` (HSDP)."""
        if self.dims.ep_replicate > 1:
            return self._submesh("ep", "ep_replicate", "ep_fsdp")
        return self._submesh("ep", "ep_fsdp")

    def _submesh(self, parent: str, *names: str) -> DeviceMesh:
        key = (parent, names)
        found = self._submeshes.get(key)
        if found is None:
            source = self.mesh if parent == "main" else self._require_ep()
            found = self._submeshes[key] = source[names[0] if len(names) == 1 else names]
        return found

    # Groups -----------------------------------------------------------------------------------------------
    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.sp_mesh.get_group()

    @property
    def fsdp_shard_group(self) -> dist.ProcessGroup:
        """Ranks that hold different shards of a dense parameter (``dp_shard * sp``); never the replicas."""
        return self.fsdp_shard_mesh.get_group()

    @property
    def dp_replicate_group(self) -> dist.ProcessGroup:
        return self._submesh("main", "dp_replicate").get_group()

    @property
    def loss_group(self) -> dist.ProcessGroup:
        return self.loss_mesh.get_group()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self._submesh("ep", "ep").get_group()

    @property
    def ep_fsdp_group(self) -> dist.ProcessGroup:
        return self._submesh("ep", "ep_fsdp").get_group()

    # Ranks and sizes ----------------------------------------------------------------------------------------
    @property
    def sp_rank(self) -> int:
        return self.sp_mesh.get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def ep_rank(self) -> int:
        return self._submesh("ep", "ep").get_local_rank() if self.dims.ep > 1 else 0

    @property
    def sp_enabled(self) -> bool:
        return self.dims.sp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.dims.ep > 1

    def _require_ep(self) -> DeviceMesh:
        if self.ep_mesh is None:
            raise ValueError(f"expert parallelism is off (ep={self.dims.ep}); there is no EP mesh")
        return self.ep_mesh


# Keyed by the default process group, so that destroying it (and creating a new one) starts afresh instead of
# handing out meshes whose groups are gone. Process groups are expensive, and asking twice for one topology must
# not create them twice; this is the module's only mutable state.
_STATE_CACHE: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[ParallelDims, str], ParallelState]] = (
    weakref.WeakKeyDictionary()
)


def build_parallel_state(dims: ParallelDims, device_type: str) -> ParallelState:
    """Create (or fetch the cached) meshes for ``dims`` over the initialised default process group.

    Args:
        dims: degrees; their product must equal the world size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL). For CUDA the current device must already be set to
            this rank's GPU.

    Returns:
        The `ParallelState`; a second call with the same arguments returns the same object.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_parallel_state needs an initialised default process group "
            "(torch.distributed.init_process_group); none is initialised"
        )
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    dims.check_world_size(dist.get_world_size())
    world = dist.group.WORLD
    if world is None:  # torch types WORLD as optional; is_initialized() above means it is set
        raise RuntimeError("build_parallel_state: the default process group is initialised but not set")
    per_world = _STATE_CACHE.setdefault(world, {})
    key = (dims, device_type)
    if key in per_world:
        return per_world[key]

    mesh = init_device_mesh(
        device_type, (dims.dp_replicate, dims.dp_shard, dims.sp), mesh_dim_names=MAIN_MESH_DIMS
    )
    # Flattened meshes are kept as returned: newer torch deprecates slicing them back out of the root mesh.
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    fsdp_shard_mesh = mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    loss_mesh = mesh["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp")
    fsdp_mesh = fsdp_shard_mesh
    if dims.dp_replicate > 1:
        # A 2-D HSDP mesh of an original dim and a flattened one can only be sliced from the root; torch warns
        # that this may go away, but it reuses the existing groups (an _unflatten would create new ones).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            fsdp_mesh = mesh["dp_replicate", "dp_shard_sp"]
    ep_mesh = None
    if dims.ep > 1:
        ep_mesh = init_device_mesh(
            device_type, (dims.ep_replicate, dims.ep_fsdp, dims.ep), mesh_dim_names=EP_MESH_DIMS
        )
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    state = ParallelState(
        dims=dims,
        device=device,
        mesh=mesh,
        dp_mesh=dp_mesh,
        fsdp_shard_mesh=fsdp_shard_mesh,
        fsdp_mesh=fsdp_mesh,
        loss_mesh=loss_mesh,
        ep_mesh=ep_mesh,
    )
    per_world[key] = state
    return state


_CURRENT_STATE: contextvars.ContextVar[ParallelState | None] = contextvars.ContextVar(
    "veomni_current_parallel_state", default=None
)


@contextlib.contextmanager
def use_parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """Make ``state`` the current state inside the ``with`` block (for code HF calls without arguments)."""
    if not isinstance(state, ParallelState):
        raise TypeError(f"use_parallel_state expects a ParallelState, got {type(state).__name__}")
    token = _CURRENT_STATE.set(state)
    try:
        yield state
    finally:
        _CURRENT_STATE.reset(token)


# Dynamo in torch 2.11 cannot trace ContextVar.get (a graph break: fatal under fullgraph=True; 2.15 can), so a compiled
# region reads the state its eager caller handed over with `hand_state_to_compiled_region` (guarded by identity).
_COMPILED_REGION_STATE: list[ParallelState | None] = [None]


@contextlib.contextmanager
def hand_state_to_compiled_region() -> Iterator[None]:
    """Around a call into ``torch.compile``d code: the current state becomes readable inside it."""
    previous = _COMPILED_REGION_STATE[0]
    _COMPILED_REGION_STATE[0] = _CURRENT_STATE.get()
    try:
        yield
    finally:
        _COMPILED_REGION_STATE[0] = previous


def _lookup() -> ParallelState | None:
    if torch.compiler.is_compiling():
        return _COMPILED_REGION_STATE[0]
    return _CURRENT_STATE.get()


def current_parallel_state_or_none() -> ParallelState | None:
    """The state set by the innermost enclosing `use_parallel_state`, or None outside every such block."""
    return _lookup()


def current_parallel_state() -> ParallelState:
    """The state set by the innermost enclosing `use_parallel_state`; raises if there is none."""
    state = _lookup()
    if state is None:
        raise RuntimeError(
            "no current ParallelState: wrap the call in `with use_parallel_state(state):` "
            "(state from veomni.core.build_parallel_state)"
        )
    return state
