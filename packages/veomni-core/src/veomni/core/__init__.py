"""veomni.core: meshes, Ulysses SP and EP collectives, FSDP2 application, cross-mesh clipping, loss maths.

Depends on torch and attrs only. The submodules hold the details (`veomni.core.sp`, `veomni.core.ep`,
`veomni.core.fsdp`, `veomni.core.master_weights`, `veomni.core.clip`, `veomni.core.loss`); this file re-exports the common entry points.
See docs/core.md for the conventions.
"""

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.clip import clip_grad_norm
from veomni.core.ep import ExpertPlan, ExpertShard, apply_expert_plan, combine_tokens, dispatch_tokens
from veomni.core.fsdp import (
    FSDPPolicy,
    StateDictMismatchError,
    apply_fsdp2,
    forward_through,
    load_full_state_dict,
    materialize_sharded,
    set_grad_sync,
)
from veomni.core.loss import count_valid_tokens, global_token_count, scale_loss_for_backward, sp_token_mean
from veomni.core.master_weights import MasterWeights, apply_master_weights, master_weights_of
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import (
    ParallelState,
    build_parallel_state,
    current_parallel_state,
    current_parallel_state_or_none,
    use_parallel_state,
)
from veomni.core.sp import gather_sequence, heads_to_seq, seq_to_heads, slice_sequence, ulysses_attention

__all__ = [
    "ExpertPlan",
    "ExpertShard",
    "FSDPPolicy",
    "MasterWeights",
    "ParallelDims",
    "ParallelState",
    "StateDictMismatchError",
    "apply_expert_plan",
    "apply_activation_checkpointing",
    "apply_fsdp2",
    "apply_master_weights",
    "build_parallel_state",
    "clip_grad_norm",
    "combine_tokens",
    "count_valid_tokens",
    "current_parallel_state",
    "current_parallel_state_or_none",
    "forward_through",
    "dispatch_tokens",
    "gather_sequence",
    "global_token_count",
    "heads_to_seq",
    "load_full_state_dict",
    "master_weights_of",
    "materialize_sharded",
    "scale_loss_for_backward",
    "seq_to_heads",
    "set_grad_sync",
    "slice_sequence",
    "sp_token_mean",
    "ulysses_attention",
    "use_parallel_state",
]
