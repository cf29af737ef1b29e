"""GLM-4.5's auxiliary-loss-free load balancing: the same rule and machinery as DeepSeek-V3's.

``Glm4MoeTopkRouter`` is DeepSeek-V3's router (fp32 sigmoid scores, ``e_score_correction_bias`` for the choice
only, group-limited top-k) and returns the same ``(logits, weights, indices)``, and GLM-4.5's report trains with
DeepSeek-V3's loss-free balancing. So the counters and the sign rule are `veomni.models.deepseek_v3.aux_free_balance`'s,
re-exported here so that the family's training hooks are reachable from its own folder:
``attach_load_counters(model)`` after materialisation, ``update_correction_biases(routers, speed)`` after every
applied optimizer step, ``reset_load_counters(routers)`` after a skipped one.
"""

from __future__ import annotations

from veomni.models.deepseek_v3.aux_free_balance import (
    LOAD,
    attach_load_counters,
    reset_load_counters,
    update_correction_biases,
)

__all__ = ["LOAD", "attach_load_counters", "reset_load_counters", "update_correction_biases"]
