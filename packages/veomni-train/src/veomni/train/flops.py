"""Matmul FLOPs of a model per trained token (the language model) and per vision patch (a VLM's tower), and the
config readings the attention FLOPs term needs; the convention is `veomni.train.metrics`'. Used by the tasks
(`veomni.train.tasks`) for MFU.

Everything read from the model config goes through ``config.get_text_config()``: a composite model keeps its
language model's settings in a sub-config.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import PretrainedConfig

from veomni.train.metrics import matmul_flops_per_token


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: ``config.get_text_config()`` (the root itself for a plain LM)."""
    return config.get_text_config()


def query_width(config: PretrainedConfig) -> float:
    """Heads x head size of the language model's attention (the width in the attention FLOPs term).

    ``QK^T`` costs the query/key head size and ``PV`` the value head size; the term assumes they are equal, so a
    model whose value heads differ (DeepSeek's MLA: ``qk_head_dim`` 192, ``v_head_dim`` 128, while its
    ``head_dim`` names only the rotary part) counts heads x their mean.
    """
    text = text_config(config)
    qk, v = getattr(text, "qk_head_dim", None), getattr(text, "v_head_dim", None)
    if qk and v:
        return text.num_attention_heads * (qk + v) / 2
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_attention_heads * head_dim


def attention_layers(config: PretrainedConfig) -> int:
    """Layers of the language model with full causal softmax attention (the quadratic FLOPs term): all of them,
    except the linear-attention layers of a hybrid (Gated DeltaNet's ``layer_types`` entries ``linear_attention``),
    whose cost is linear in the length (projections, plus `gated_delta_rule_flops_per_token`), and the
    sliding-window layers (`sliding_window_layers`)."""
    text = text_config(config)
    kinds = getattr(text, "layer_types", None) or ()
    return (
        int(text.num_hidden_layers)
        - sum(kind == "linear_attention" for kind in kinds)
        - sliding_window_layers(config)[0]
    )


GATED_DELTA_CHUNK = 64
"""Chunk length of the gated delta rule kernels (fla's is fixed at 64; the eager oracle's default)."""


def gated_delta_rule_flops_per_token(config: PretrainedConfig, chunk: int = GATED_DELTA_CHUNK) -> float:
    """Training FLOPs per token of the Gated DeltaNet recurrences (``layer_types`` entry ``linear_attention``), which
    no weight accounts for: 3x the forward, as the attention term.

    The chunked (WY) form's matmuls per value head, per chunk of ``C`` tokens, state ``S [dk, dv]``: ``K K^T`` and
    ``Q K^T`` (``2 C**2 dk`` each), ``W = T (beta K)`` and ``U = T (beta V)`` with the chunk's triangular inverse
    ``T`` (``2 C**2 dk``, ``2 C**2 dv``), ``(Q K^T) V_new`` (``2 C**2 dv``), and ``W S``, ``Q S``, ``K^T V_new``
    (``2 C dk dv`` each). Per token, forward: ``6 dk dv + 2 C (3 dk + 2 dv)``. The C x C products are whole tiles
    (the kernels mask after the product), so they count in full. Not counted: the inverse itself (``C**3 / 3``
    per chunk, ~1.5% at C = 64, dk = dv = 128) and elementwise work (gates, l2 norm); the short convolution is
    a weight (``conv1d``), counted with them. The eager oracle applies ``T`` by triangular solves, which
    ``FlopCounterMode`` does not count: it sees ``6 dk dv + 2 C (2 dk + dv)``.
    """
    text = text_config(config)
    kinds = list(getattr(text, "layer_types", None) or ())[: int(text.num_hidden_layers)]
    layers = sum(kind == "linear_attention" for kind in kinds)
    if not layers:
        return 0.0
    dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    forward = 6 * dk * dv + 2 * chunk * (3 * dk + 2 * dv)
    return 3.0 * layers * int(text.linear_num_value_heads) * forward


def sliding_window_layers(config: PretrainedConfig) -> tuple[int, int | None]:
    """``(layers, window)``: the language model's sliding-window attention layers (``layer_types`` entries
    ``sliding_attention``, gpt-oss's every other layer) and the window they attend over; ``(0, None)`` without."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    layers = sum(kind == "sliding_attention" for kind in getattr(text, "layer_types", None) or ())
    return (layers, int(window)) if layers and window else (0, None)


def flops_per_token(probe: nn.Module, counted: Callable[[str], bool] = lambda name: True) -> float:
    """``6 * N_active`` (frozen weights less, `veomni.train.metrics.matmul_flops_per_token`): matmul FLOPs per
    trained token of ``probe`` (an unsharded or meta instance, frozen as it will train); routed expert weights count
    ``top_k / E`` of their size. ``counted`` picks the parameter names counted (a VLM counts its tower per patch).
    A hybrid's Gated DeltaNet recurrences add `gated_delta_rule_flops_per_token`."""
    text = text_config(probe.config)
    experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
    fraction = text.num_experts_per_tok / experts if experts else 1.0
    expert_names = [n for n, _ in probe.named_parameters() if ".experts." in n]
    recurrence = gated_delta_rule_flops_per_token(probe.config)
    return matmul_flops_per_token(probe, expert_names, fraction, counted) + recurrence


def vision_flops_per_patch(visual: nn.Module, merge: int) -> float:
    """``6 * N`` matmul FLOPs per vision patch: every weight of the tower multiplies each patch, except the
    patch mergers (names containing ``merger``), which run once per ``merge**2`` patches, and embedding tables
    (Qwen3-VL's learned ``pos_embed``: looked up, not multiplied). Frozen weights count 2 (forward) instead of 6
    until the first trained one, 4 after it (`veomni.train.metrics.matmul_flops_per_token`: nothing runs before
    the tower). The tower's own attention score FLOPs are not counted."""
    lookups = {id(m.weight) for m in visual.modules() if isinstance(m, nn.Embedding)}
    total, trained_before = 0.0, False
    for name, param in visual.named_parameters():
        passes = 6.0 if param.requires_grad else (4.0 if trained_before else 2.0)
        trained_before = trained_before or param.requires_grad
        if param.dim() < 2 or id(param) in lookups:
            continue
        total += passes * param.numel() / (merge * merge if "merger" in name else 1)
    return total
