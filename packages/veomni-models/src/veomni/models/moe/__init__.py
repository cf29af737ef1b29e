"""Mixture-of-experts helpers shared by every MoE family: router load statistics and auxiliary-loss-free balancing."""
