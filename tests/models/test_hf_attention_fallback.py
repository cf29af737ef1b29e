"""A model from ``build_model`` runs what veomni's attention kernels do not take -- left-padded batched generation,
a static cache, a pre-built 4-D mask, ``output_attentions`` -- through transformers' own attention for that call,
and equals upstream transformers there; the training shape still runs the kernel."""

from __future__ import annotations

import copy

import torch
import transformers

from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.hf import attention_fallback as hf_attention_fallback

VOCAB, PAD = 96, 0
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=PAD,
)  # fmt: skip
# veomni's sdpa attention entry, every other op eager: the comparison isolates the attention routing.
OPS = OpsConfig(
    attention="sdpa", rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager", moe_experts="eager",
    load_balancing_loss="eager",
)  # fmt: skip
GREEDY = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD)


def _pair(upstream_attention: str = "sdpa") -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours from build_model, upstream Qwen3ForCausalLM with the same weights and ``upstream_attention``)."""
    config = transformers.Qwen3Config(**TINY)
    torch.manual_seed(0)
    ours = build_model(copy.deepcopy(config), ops=OPS, init_device="cpu").eval()
    assert ours.config._attn_implementation == "veomni_sdpa"
    upstream = transformers.Qwen3ForCausalLM(config).eval()
    upstream.load_state_dict(ours.state_dict())
    upstream.set_attn_implementation(upstream_attention)
    return ours, upstream


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as batched generation pads
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    calls = {"hf": 0}
    real = hf_attention_fallback.sdpa_attention_forward

    def counting(*args, **kwargs):
        calls["hf"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention_fallback, "sdpa_attention_forward", counting)
    return calls


def test_left_padded_batched_generation_equals_upstream_per_row():
    ours, upstream = _pair()
    ids, mask = _left_padded()
    with torch.no_grad():
        want = upstream.generate(ids, attention_mask=mask, **GREEDY)
        got = ours.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    # Each row alone (no padding: the kernel path) generates the same continuation as inside the padded batch.
    for row in range(ids.shape[0]):
        prompt = ids[row, mask[row].bool()][None]
        with torch.no_grad():
            alone = ours.generate(prompt, **GREEDY)
        assert torch.equal(alone[0, -GREEDY["max_new_tokens"] :], got[row, -GREEDY["max_new_tokens"] :])


def test_left_padded_forward_equals_upstream_and_right_padding_keeps_the_kernel(monkeypatch):
    ours, upstream = _pair()
    ids, mask = _left_padded()
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        want, got = upstream(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    assert calls["hf"] == 2  # both layers through transformers' sdpa
    # Right padding and no mask: the training shape, still veomni's kernel.
    right = mask.flip(1)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, attention_mask=right).logits[right.bool()],
            upstream(ids, attention_mask=right).logits[right.bool()],
            rtol=1e-5,
            atol=1e-5,
        )
        assert ours(ids).logits.shape[:2] == ids.shape
    assert calls["hf"] == 2


def test_static_cache_generation_equals_upstream():
    ours, upstream = _pair()
    ids, mask = _left_padded()
    settings = dict(GREEDY, cache_implementation="static")
    with torch.no_grad():
        want = upstream.generate(ids, attention_mask=mask, **settings)
        got = ours.generate(ids, attention_mask=mask, **settings)
        got_unpadded = ours.generate(ids[:1], **settings)
        want_unpadded = upstream.generate(ids[:1], **settings)
    assert torch.equal(got, want)
    assert torch.equal(got_unpadded, want_unpadded)


def test_a_4d_mask_forward_equals_upstream():
    ours, upstream = _pair()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    # A block-causal mask: tokens 0..2 and 3..5 are two documents (bool: True attends).
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    causal[3:, :3] = False
    mask = causal[None, None].expand(2, 1, 6, 6)
    with torch.no_grad():
        want, got = upstream(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # The float (additive) form of the same mask, as older code builds it.
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        torch.testing.assert_close(ours(ids, attention_mask=additive).logits, want, rtol=1e-5, atol=1e-5)


def test_output_attentions_equal_upstream_eager():
    ours, upstream = _pair("eager")
    ids, mask = _left_padded()
    for kwargs in ({}, {"attention_mask": mask}):
        with torch.no_grad():
            want = upstream(ids, output_attentions=True, **kwargs)
            got = ours(ids, output_attentions=True, **kwargs)
        assert len(got.attentions) == len(want.attentions) == 2
        for a, b in zip(got.attentions, want.attentions, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        keep = mask.bool() if kwargs else torch.ones_like(mask, dtype=torch.bool)
        torch.testing.assert_close(got.logits[keep], want.logits[keep], rtol=1e-5, atol=1e-5)
    assert ours(ids).attentions is None  # the default path is untouched
