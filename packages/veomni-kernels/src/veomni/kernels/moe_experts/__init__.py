"""MoE experts (SwiGLU, HF's fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` layout).

Two registry variants of the op ``moe_experts``:
- ``routed``: ``fn(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up_proj, down_proj) -> [T, H]``,
  the whole routed-experts computation (permute, grouped GEMMs, SwiGLU, weighted combine in fp32);
- ``grouped``: ``fn(x [N, H], tokens_per_expert [E], gate_up_proj, down_proj) -> [N, H]`` on rows already
  grouped by expert (what expert-parallel dispatch returns).

Backends: ``eager`` (a loop over experts, the oracle), ``torch`` (``torch._grouped_mm``), ``triton`` (ours).
"""

from veomni.kernels.moe_experts.eager import moe_experts_grouped_eager, moe_experts_routed_eager

__all__ = ["moe_experts_grouped_eager", "moe_experts_routed_eager"]
