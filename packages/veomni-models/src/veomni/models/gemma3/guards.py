"""Configurations and kernel choices the Gemma 3 adapter refuses, with the reason, instead of computing them wrong.

Imported by the generated modeling file (``generated/patched_modeling_gemma3.py``); see the patch config for where
each check runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_attention_softcap", "check_swiglu_choice"]


def check_attention_softcap(config: Any) -> None:
    """Raise ``ValueError`` if the (text) config sets ``attn_logit_softcapping``.

    transformers' ``Gemma3Attention`` stores ``config.attn_logit_softcapping`` but never passes it to the attention
    function (Gemma 3 replaced Gemma 2's attention soft-cap by the q/k norms; the field is a leftover of the Gemma 2
    config). A model built from such a config therefore computes uncapped attention upstream, while every capable
    veomni backend would cap it: whichever one we ran would silently differ from what the config says or from what
    upstream computes. Released Gemma 3 checkpoints set it to null.

    Args:
        config: a ``Gemma3TextConfig`` or a composite config whose ``get_text_config()`` is one.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text_config, "attn_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"gemma3: config.attn_logit_softcapping={cap!r}, but transformers' Gemma 3 attention never applies it "
            "(Gemma3Attention does not pass softcap to its attention function), so veomni cannot both honour it and "
            "match upstream. Set attn_logit_softcapping to null (what transformers computes for this config; "
            "released Gemma 3 checkpoints have null)"
        )


def check_swiglu_choice(kernels: Any, hidden_activation: str) -> None:
    """Raise ``ValueError`` if ``OpsConfig.swiglu`` was set explicitly to a kernel for Gemma 3's MLP.

    Gemma 3's MLP is ``down(act(gate) * up)`` with ``act = hidden_activation`` (``gelu_pytorch_tanh``): the swiglu
    kernels compute ``silu(gate) * up``, so an explicit choice cannot be honoured. A *defaulted* backend (the
    hardware's pick, e.g. Triton on CUDA) is not an instruction: the MLP then runs upstream's maths.

    Args:
        kernels: the module's ``veomni.kernels.Kernels``.
        hidden_activation: the config's ``hidden_activation``.
    """
    ops = kernels.config
    if ops.swiglu != "eager" and "swiglu" not in ops.defaulted:
        raise ValueError(
            f"OpsConfig.swiglu={ops.swiglu!r} computes silu(gate) * up, but Gemma 3's MLP is "
            f"{hidden_activation}(gate) * up; set swiglu='eager' or leave it unset"
        )
