"""Linear cross-entropy (LM head or classifier head + CE), returning (loss_sum, valid_count).

Backends: ``eager`` (the oracle, materialises fp32 logits), ``triton`` (fused: chunked GEMMs, one Triton pass
per chunk, fp32 dW, no host sync) and ``liger`` (liger-kernel's fused function, for comparison).
"""
