"""Adapter conformance: every registered transformers model type with a ``causal_lm`` class, built from its tiny
config in `conformance_table`, passes the same four checks on CPU (gloo for SP):

- parity: our adapter equals transformers' own class for the config (the ``AutoModelForCausalLM`` mapping) bit for
  bit in eager mode, upstream's weights loaded into ours: logits, loss and every gradient (so the grad norm too);
- packed: one packed row with veomni's varlen kwargs equals each document run alone (logits, loss, gradients),
  and the same row without the packing information does not (the check can fail);
- sp: Ulysses SP over 2 gloo ranks equals one process (logits, summed-loss gradients), where the model type lists
  the ``sp`` fast path; again with the async exchange (``parallel.async_ulysses``) where its family declares
  attention classes with the async branch (`veomni.models.family.ModelTypeSpec.async_ulysses`), and every SP model
  type of every family either declares them or says why it has none;
- export: a checkpoint upstream wrote, built through the registry, exported with `export_hf` and reloaded with
  plain transformers, gives upstream's weights (same keys, same values, same file layout) and our logits.

A registered model type without a row fails every cell, naming itself; a row says why a cell is skipped.
Family-specific behaviour (GPT-OSS sinks kernels, DeepSeek-V3 aux-free balancing, MoE EP grids, kernel
combinations) stays in the per-family modules.
"""

from __future__ import annotations

import copy
import inspect
import sys

import pytest
import torch
from adapter_helpers import run, sp_against_one_process
from conformance_table import CHECKS, ROWS, Row
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
)

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.families import FAMILIES, family_of
from veomni.models.hf.async_sp import check_async_ulysses, enable_async_ulysses
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.registry import MODELS, config_for_class

MODEL_TYPES = sorted(
    t
    for t in MODELS.model_types()
    if MODELS.entry(t).library == "transformers" and "causal_lm" in MODELS.entry(t).classes
)

# Every op on its eager formula (compile off: "auto" would compile on a GPU host); attention through veomni's sdpa,
# which reads the packing from the varlen kwargs.
EAGER_OPS = dict(
    attention="sdpa", rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager", cross_entropy="eager",
    load_balancing_loss="eager", gated_delta_rule="eager", causal_conv1d="eager", rms_norm_gated="eager",
    compile="off",
)  # fmt: skip
DOCUMENTS = (7, 12, 5)


def row_for(model_type: str, check: str) -> Row:
    """The table row of ``model_type``; fails naming a model type without one, skips a cell the row excludes."""
    assert check in CHECKS
    row = ROWS.get(model_type)
    if row is None:
        pytest.fail(
            f"model_type {model_type!r} is registered with a causal_lm class but has no row in "
            f"tests/models/conformance_table.py (ROWS); add its tiny config there"
        )
    if check in row.skip:
        pytest.skip(f"{model_type} / {check}: {row.skip[check]}")
    return row


def tiny_config(model_type: str, attn: str = "sdpa", **overrides: object) -> PretrainedConfig:
    """The row's config with ``overrides`` (``"text_config.x"`` keys set the text config) and ``attn`` as the
    attention implementation of the config and its text config."""
    config = ROWS[model_type].config()
    for key, value in overrides.items():
        target, _, name = key.rpartition(".")
        setattr(getattr(config, target) if target else config, name, value)
    for sub in {id(c): c for c in (config, config.get_text_config())}.values():
        sub._attn_implementation = attn
        sub._experts_implementation = "eager"
    return config


def use_torch_fallback(monkeypatch: pytest.MonkeyPatch, row: Row, upstream_class: type) -> None:
    """Point upstream's fla-dispatching functions at their torch originals (see `Row.torch_fallback`)."""
    module = sys.modules[upstream_class.__module__]
    for name in row.torch_fallback:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, getattr(fn, "__wrapped__", fn))


def build_ours(model_type: str, attn: str = "eager", **overrides: object) -> torch.nn.Module:
    """Our registered ``causal_lm`` class on the tiny config, seeded, with the row's perturbation (``attn`` eager:
    transformers refuses sdpa for some classes at construction; `apply_ops` then picks veomni's)."""
    config = tiny_config(model_type, attn, **overrides)
    cls = MODELS.model_class(config, "causal_lm").cls
    torch.manual_seed(0)
    model = cls(config_for_class(config, cls))
    if ROWS[model_type].perturb is not None:
        ROWS[model_type].perturb(model)
    return model


def batch(lengths: tuple[int, ...] = DOCUMENTS, rows: int = 1, seed: int = 1) -> dict[str, torch.Tensor]:
    """``rows`` rows of packed documents (int64 ``[rows, sum(lengths)]``); each document's first token is
    unlabelled, so no target crosses a document boundary."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(rows, -1)
    labels = ids.clone()
    labels[:, torch.cumsum(torch.tensor((0, *lengths[:-1])), 0)] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def no_aux(model: torch.nn.Module) -> dict[str, bool]:
    # The MoE load-balancing loss is a statistic of the whole row: a packed row and its documents differ in it.
    return {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}


# ---------------------------------------------------------------- the table covers the registry


def test_every_registered_causal_lm_has_a_row():
    missing = [t for t in MODEL_TYPES if t not in ROWS]
    stale = sorted(set(ROWS) - set(MODEL_TYPES))
    assert not missing, f"registered causal_lm model types without a conformance row: {missing}"
    assert not stale, f"conformance rows for model types the registry lacks (or without causal_lm): {stale}"


# ---------------------------------------------------------------- parity with upstream


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_parity_with_upstream_is_bitwise(model_type, attn, monkeypatch):
    row = row_for(model_type, "parity" if attn == "eager" else "parity_sdpa")
    config = tiny_config(model_type, attn)
    upstream_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    use_torch_fallback(monkeypatch, row, upstream_class)
    torch.manual_seed(0)
    upstream = upstream_class(config_for_class(copy.deepcopy(config), upstream_class))
    if row.perturb is not None:
        row.perturb(upstream)
    ours_class = MODELS.model_class(config, "causal_lm").cls
    assert ours_class is not upstream_class and ours_class.__name__ == upstream_class.__name__
    ours = ours_class(config_for_class(config, ours_class))
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected

    inputs = {k: v for k, v in batch(rows=2).items() if k != "position_ids"}  # two plain rows
    want, got = run(upstream, inputs), run(ours, inputs)
    assert torch.equal(got[0], want[0]), f"logits differ by {(got[0] - want[0]).abs().max():.3g}"
    assert torch.equal(got[1], want[1]), f"loss {got[1]} != upstream's {want[1]}"
    assert got[2].keys() == want[2].keys()
    differ = [n for n, g in want[2].items() if not torch.equal(got[2][n], g)]
    assert not differ, f"gradients differ from upstream's: {differ}"


# ---------------------------------------------------------------- packed == per-document


def assert_close(got, want, tol: float = 2e-5) -> None:
    """Logits, loss and each gradient within ``tol`` (a gradient's absolute slack scales with its largest
    element)."""
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=tol, atol=tol * float(grad.abs().max()) + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_row_equals_documents_run_alone(model_type):
    row_for(model_type, "packed")
    model = build_ours(model_type)
    apply_ops(model, OpsConfig(**EAGER_OPS))
    inputs = batch()
    packed = run(model, inputs, **packed_kwargs(inputs["position_ids"]), **no_aux(model))

    # The oracle: each document through the same model on its own; HF's loss (shifted labels, mean over labelled
    # tokens) over the concatenated logits.
    model.zero_grad(set_to_none=True)
    starts = (0, *torch.cumsum(torch.tensor(DOCUMENTS), 0).tolist())
    logits = torch.cat(
        [model(input_ids=inputs["input_ids"][:, a:b], use_cache=False, **no_aux(model)).logits
         for a, b in zip(starts, starts[1:], strict=False)], 1,
    )  # fmt: skip
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], inputs["labels"][0, 1:], ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_close(packed, (logits.detach(), loss.detach(), grads))

    # Without the packing the later documents attend to (or carry state from) the earlier ones.
    with torch.no_grad():
        leaky = model(input_ids=inputs["input_ids"], use_cache=False, **no_aux(model)).logits
    assert not torch.allclose(leaky[:, DOCUMENTS[0] :], packed[0][:, DOCUMENTS[0] :], atol=1e-3)


# ---------------------------------------------------------------- Ulysses SP == one process


def _sp_case(ctx, model_type: str, exchange: str = "sync") -> dict[str, float]:
    """One packed row of odd length (the SP padding path runs) through our adapter, whole and sliced over the
    ranks (``exchange`` ``"async"``: the attention's projections overlapping the exchange): the largest logit
    error, the worst gradient error in units of its tolerance, missing gradients, async attention layers."""
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    model = build_ours(model_type, **ROWS[model_type].sp_overrides)
    apply_ops(model, OpsConfig(**EAGER_OPS))
    layers = enable_async_ulysses(model, model_type) if exchange == "async" else 0
    inputs = batch(lengths=(7, 1, 5), seed=4)
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    labels = torch.cat([inputs["labels"][:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # pre-shifted
    kwargs = dict(packed_kwargs(positions), use_cache=False, **no_aux(model))
    worst = sp_against_one_process(
        model, state, ids, positions, labels, whole=kwargs, sharded=dict(kwargs, sp_unpadded_len=ids.shape[1])
    )
    return {**worst, "async": layers}


@pytest.mark.parametrize("exchange", ["sync", "async"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sp_equals_single_process(dist_pools, model_type, exchange):
    row_for(model_type, "sp" if exchange == "sync" else "async_sp")
    if "sp" not in MODELS.entry(model_type).fast_paths:
        pytest.skip(f"{model_type} does not list the 'sp' fast path")
    spec = family_of(model_type).spec(model_type)
    if exchange == "async" and not spec.async_ulysses:
        pytest.skip(f"{model_type} has no async Ulysses path: {spec.no_async_ulysses}")
    for worst in dist_pools.get(2).run(_sp_case, model_type, exchange):
        assert worst["missing"] == 0 and worst["logits"] < 1e-4 and worst["grad"] <= 1.0, worst
        # Every attention layer took the async path (the tiny configs have no layer without attention).
        want_async = (
            ROWS[model_type].config().get_text_config().num_hidden_layers if exchange == "async" else 0
        )
        assert worst["async"] == want_async, worst


SP_TYPES = sorted(
    (family.name, spec.model_type)
    for family in FAMILIES
    for spec in family.model_types
    if "sp" in spec.fast_paths
)


@pytest.mark.parametrize("family_name, model_type", SP_TYPES)
def test_every_sp_model_type_declares_its_async_ulysses_path_or_why_not(family_name, model_type):
    """A declared class's forward really has the async branch; a model type without one is refused before any
    model is built, with its family's reason."""
    spec = family_of(model_type).spec(model_type)
    if spec.async_ulysses:
        for cls in check_async_ulysses(model_type):
            assert "async_ulysses_active(self" in inspect.getsource(cls.forward), cls
        return
    with pytest.raises(ValueError) as err:
        check_async_ulysses(model_type)
    assert spec.no_async_ulysses in str(err.value) and "parallel.async_ulysses=false" in str(err.value)


# ---------------------------------------------------------------- export round trip


def _tensor_keys(directory) -> set[str]:
    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys.update(f.keys())
    return keys


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_round_trip_gives_upstreams_weights(model_type, monkeypatch, tmp_path):
    row = row_for(model_type, "export")
    src, out = tmp_path / "src", tmp_path / "out"
    config = tiny_config(model_type, "eager")
    upstream_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    use_torch_fallback(monkeypatch, row, upstream_class)
    # A composite (VLM) model type's checkpoints are the VLM's: write one, as released, and train it text-only.
    composite = config_for_class(config, upstream_class) is not config
    source_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)] if composite else upstream_class
    torch.manual_seed(0)
    source = source_class(copy.deepcopy(config))
    if row.perturb is not None:
        row.perturb(source)
    source.save_pretrained(src)

    model = build_model(str(src), weights=str(src), ops=OpsConfig(**dict(EAGER_OPS, attention="eager")),
                        task="causal_lm", init_device="cpu").eval()  # fmt: skip
    assert type(model) is MODELS.model_class(config, "causal_lm").cls
    export_hf(model, out)
    reference = AutoModelForCausalLM.from_pretrained(src).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(reference) is upstream_class
    want, got = reference.state_dict(), reloaded.state_dict()
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"exported weights differ from the source's: {differ}"
    if not composite:  # the same file layout (e.g. per-expert tensors) as upstream's own save
        assert _tensor_keys(out) == _tensor_keys(src)
    ids = batch(rows=2)["input_ids"]
    with torch.no_grad():
        theirs = reloaded(input_ids=ids).logits
        assert torch.equal(theirs, reference(input_ids=ids).logits)
        torch.testing.assert_close(model(input_ids=ids).logits, theirs, rtol=1e-5, atol=1e-5)
