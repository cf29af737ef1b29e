"""Per-token log-probabilities of targets and the softmax entropy, from hidden states and the LM-head weight.

``linear_log_probs(hidden, weight, targets, *, ignore_index, logit_softcap, temperature, entropy)`` returns
``(logps, entropy)`` per token (fp32), differentiable w.r.t. hidden and weight through both. Backends: ``eager``
(the oracle, materialises fp32 logits), ``chunked`` (plain torch, token chunks, any device) and ``triton``
(cuBLAS chunks plus one fused Triton row pass; backward recomputes each chunk's logits from saved row stats).
"""
