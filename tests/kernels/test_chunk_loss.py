"""The ``chunk_loss`` cross-entropy backend: equal to eager CE (values and gradients), never a [T, V] tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from veomni.kernels import KERNELS
from veomni.kernels.cross_entropy import chunked, eager


def _inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, *, ignore_every: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=gen) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = eager.IGNORE_INDEX
    return h, w, labels


def _loss_and_grads(fn, h, w, labels, **kw):
    h, w = (
        h.detach().clone().requires_grad_(h.requires_grad),
        w.detach().clone().requires_grad_(w.requires_grad),
    )
    loss, count = fn(h, w, labels, **kw)
    leaves = [t for t in (h, w) if t.requires_grad]
    grads = torch.autograd.grad(loss * 0.7, leaves)  # a non-unit upstream gradient reaches backward's scaling
    return loss.detach(), count, grads


def _fp64_oracle(h, w, labels, **kw):
    h64 = h.detach().double().requires_grad_(h.requires_grad)
    w64 = w.detach().double().requires_grad_(w.requires_grad)
    loss, count = eager.linear_ce_unchecked(
        h64, w64, labels, kw.get("ignore_index", -100), kw.get("logit_softcap"), kw.get("z_loss_weight", 0.0)
    )
    leaves = [t for t in (h64, w64) if t.requires_grad]
    return loss.detach(), count, torch.autograd.grad(loss * 0.7, leaves)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 64])
@pytest.mark.parametrize(
    "features",
    [{}, {"logit_softcap": 2.5}, {"z_loss_weight": 1e-2}, {"logit_softcap": 4.0, "z_loss_weight": 1e-3}],
)
def test_fp32_equals_eager_values_and_gradients(chunk_tokens, features):
    h, w, labels = _inputs(13, 16, 37, torch.float32)
    got_loss, got_count, got_grads = _loss_and_grads(
        chunked.chunked_linear_cross_entropy, h, w, labels, chunk_tokens=chunk_tokens, **features
    )
    want_loss, want_count, want_grads = _fp64_oracle(h, w, labels, **features)
    assert got_count.item() == want_count.item() == 8  # 13 rows, every third ignored
    torch.testing.assert_close(got_loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_bf16_matches_eager_and_non_default_ignore_index():
    h, w, labels = _inputs(20, 32, 50, torch.bfloat16, ignore_every=0)
    labels[3] = labels[11] = 7  # ignore_index=7 drops these and keeps the -100-free rest
    kw = {"ignore_index": 7}
    got_loss, got_count, got_grads = _loss_and_grads(chunked.causal_lm_cross_entropy, h, w, labels, **kw)
    want_loss, want_count, want_grads = _loss_and_grads(eager.causal_lm_cross_entropy, h, w, labels, **kw)
    assert got_count.item() == want_count.item() == int((labels != 7).sum())
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-4)
    _, _, exact = _fp64_oracle(h, w, labels, **kw)
    for got, want, ref in zip(got_grads, want_grads, exact, strict=True):
        assert got.dtype == torch.bfloat16
        # Both round to bf16 at different points; ours (fp32 dW, rounded once) is no further from the fp64 truth.
        ours, theirs = (got.double() - ref).abs().max(), (want.double() - ref).abs().max()
        assert ours <= theirs * 1.05 + 1e-6, (ours, theirs)
        torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=4e-3)


def test_all_ignored_gives_zero_loss_and_zero_grads_and_frozen_weight():
    h, w, labels = _inputs(6, 8, 11, torch.float32)
    labels[:] = -100
    loss, count, (gh, gw) = _loss_and_grads(chunked.causal_lm_cross_entropy, h, w, labels)
    assert loss.item() == 0.0 and count.item() == 0
    assert not gh.any() and not gw.any()
    w.requires_grad_(False)
    _, _, grads = _loss_and_grads(chunked.causal_lm_cross_entropy, h, w, _inputs(6, 8, 11, torch.float32)[2])
    assert len(grads) == 1 and grads[0].shape == h.shape


def test_no_grad_gives_the_loss_without_gradient_gemms():
    h, w, labels = _inputs(10, 8, 13, torch.float32)
    with torch.no_grad(), _LargestTensor() as probe:
        loss, count = chunked.chunked_linear_cross_entropy(h, w, labels, chunk_tokens=4)
    torch.testing.assert_close(loss, eager.causal_lm_cross_entropy(h, w, labels)[0].detach())
    assert not loss.requires_grad and count.item() == 6
    # One logits GEMM per chunk (3 chunks), no dX/dW GEMMs.
    gemms = [name for name in probe.ops if name.split(".")[0] in ("mm", "addmm", "bmm")]
    assert len(gemms) == 3, probe.ops


def test_seq_cls_and_leading_dims():
    h, w, labels = _inputs(5, 12, 3, torch.float32, ignore_every=0)
    got = chunked.sequence_classification_cross_entropy(h, w, labels)
    want = eager.sequence_classification_cross_entropy(h, w, labels)
    torch.testing.assert_close(got[0], want[0])
    with pytest.raises(ValueError, match=r"hidden must be \[B, H\]"):
        chunked.sequence_classification_cross_entropy(h.view(1, 5, 12), w, labels.view(1, 5))
    # [B, S, H] input for the causal variant.
    h3, w3, l3 = _inputs(12, 8, 9, torch.float32)
    got3 = chunked.causal_lm_cross_entropy(h3.view(3, 4, 8), w3, l3.view(3, 4))
    torch.testing.assert_close(got3[0], eager.causal_lm_cross_entropy(h3, w3, l3)[0])


def test_bad_arguments_raise_clear_errors():
    h, w, labels = _inputs(4, 8, 11, torch.float32)
    with pytest.raises(ValueError, match=r"chunk_tokens must be an int >= 1, got 0"):
        chunked.chunked_linear_cross_entropy(h, w, labels, chunk_tokens=0)
    with pytest.raises(TypeError, match=r"labels must be int64"):
        chunked.causal_lm_cross_entropy(h, w, labels.int())
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        chunked.causal_lm_cross_entropy(h, w[0], labels)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_logits_tensor_is_materialised():
    tokens, hidden, vocab, chunk = 64, 8, 300, 16
    h, w, labels = _inputs(tokens, hidden, vocab, torch.float32)
    with _LargestTensor() as probe:
        loss, _ = chunked.chunked_linear_cross_entropy(h, w, labels, chunk_tokens=chunk)
        loss.backward()
    # Nothing bigger than one chunk's [C, V] logits exists (the eager path makes [T, V]).
    assert probe.largest == chunk * vocab < tokens * vocab
    with _LargestTensor() as eager_probe:
        eager.causal_lm_cross_entropy(h, w, labels)[0].backward()
    assert eager_probe.largest >= tokens * vocab  # the probe does see a full logits tensor when one exists


def test_registered_as_portable_backend_and_npu_default():
    from veomni.kernels import DEFAULT_BACKENDS, Hardware

    for variant in ("causal", "seq_cls"):
        spec = KERNELS.get("cross_entropy", variant, "chunk_loss")
        for device in ("cpu", "cuda", "npu"):
            assert spec.requires.unmet(Hardware(device_type=device)) is None
    assert DEFAULT_BACKENDS["cross_entropy"]["npu"] == "chunk_loss"


@pytest.mark.cuda
def test_cuda_real_shape_matches_triton_and_eager():
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(2048, 2048, generator=gen) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(151_936, 2048, generator=gen) * 0.02).to("cuda", torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 151_936, (2048,), generator=gen).cuda()
    labels[::5] = -100
    got = _loss_and_grads(chunked.causal_lm_cross_entropy, h, w, labels)
    want = _loss_and_grads(eager.causal_lm_cross_entropy, h, w, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-2)
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-4)
