"""Expert parallelism: dim-0 sharding of fused expert parameters and top-k token dispatch/combine."""

from veomni.core.ep.dispatch import DispatchHandle, all_to_all_rows, combine_tokens, dispatch_tokens
from veomni.core.ep.plan import (
    ExpertPlan,
    ExpertShard,
    apply_expert_plan,
    expert_module_fqns,
    expert_shard_of,
    expert_shards,
)

__all__ = [
    "DispatchHandle",
    "ExpertPlan",
    "ExpertShard",
    "all_to_all_rows",
    "apply_expert_plan",
    "combine_tokens",
    "dispatch_tokens",
    "expert_module_fqns",
    "expert_shard_of",
    "expert_shards",
]
