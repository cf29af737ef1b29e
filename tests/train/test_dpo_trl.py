"""The dpo task's losses equal TRL's on the same tokens, gradients included.

TRL tokenises and pads the pairs (its collator's ``[chosen; rejected]`` rows); the same tokens are packed the way
the preference data kind packs them (one sample of two segments per pair, `veomni.train.data.pairs`) and scored by
`veomni.train.tasks.preference.DpoTask` on a veomni-built copy of the model. DPO variants run against TRL's
``DPOTrainer``, SimPO against ``CPOTrainer`` and ORPO against ``ORPOTrainer``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.train.data import Step
from veomni.train.data.encode import Sample
from veomni.train.data.packing import collate
from veomni.train.data.pairs import PairSegments
from veomni.train.recipe import ASSETS_DIR
from veomni.train.recipe.dpo_section import DpoSection
from veomni.train.tasks.preference import DpoTask

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

TOKENIZER = ASSETS_DIR / "quickstart" / "tokenizer"
PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "It is 7, I think."},
    {"prompt": "Reverse 'cat'.", "chosen": "'tac'", "rejected": "cat"},
    {"prompt": "Sort 3, 1, 2.", "chosen": "1, 2, 3", "rejected": "3, 2, 1 sorted is 3, 1"},
]


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip


def models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An HF model (TRL's policy) and a veomni-built one with the same weights, fp32 on CPU."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    # Untrained models score both answers alike; a perturbation makes the pair terms non-trivial.
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = build_model(tiny_config(), ops=OpsConfig(), dtype=torch.float32, device="cpu")
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def packed_batch(input_ids: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor) -> dict:
    """TRL's padded ``[chosen rows; rejected rows]`` as veomni packs pairs: per pair one sample of two segments."""
    pairs = input_ids.shape[0] // 2
    samples = []
    for i in range(pairs):
        parts = []
        for row in (i, pairs + i):
            keep = attention[row].bool()
            parts.append((input_ids[row][keep].numpy(), completion[row][keep].bool().numpy()))
        ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
        trained = np.concatenate([p[1] for p in parts])
        samples.append(Sample(ids, trained, i, media=PairSegments((len(parts[0][0]),))))
    return collate(samples)


def ours_loss_and_grads(task: DpoTask, model: torch.nn.Module, batch: dict) -> tuple[float, dict]:
    step = Step(step=0, epoch=0, micro_batches=[batch], tokens=0, valid_tokens=1)
    num_items = task.step_normaliser(step, torch.device("cpu"))
    outputs = task.forward(model, batch, torch.device("cpu"), num_items)
    loss, objective = task.loss(outputs, 1.0)
    objective.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(ours: dict, theirs: torch.nn.Module) -> None:
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=2e-4, atol=2e-6, msg=name)


def dpo_trainer(
    tmp_path, model, ref, loss_type: list[str], weights: list[float] | None = None, beta: float = 0.1
):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path), beta=beta, loss_type=loss_type, loss_weights=weights,
        per_device_train_batch_size=len(PAIRS), report_to=[], use_cpu=True, disable_dropout=True,
        dataloader_num_workers=0, max_length=None, save_strategy="no", bf16=False,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    return DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(PAIRS),
        processing_class=tokenizer,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("loss", "trl_types", "trl_weights", "sft_weight"),
    [
        ("sigmoid", ["sigmoid"], None, 0.0),
        ("hinge", ["hinge"], None, 0.0),
        ("ipo", ["ipo"], None, 0.0),
        ("sigmoid_norm", ["sigmoid_norm"], None, 0.0),
        ("sigmoid", ["sigmoid", "sft"], [1.0, 0.5], 0.5),
    ],
)
def test_dpo_losses_and_gradients_equal_trl(tmp_path, loss, trl_types, trl_weights, sft_weight):
    hf, ours = models()
    # The reference: the unperturbed start (a different model than the policy, so the log-ratios are not 0).
    torch.manual_seed(1)
    hf_ref = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    ours_ref = build_model(tiny_config(), ops=OpsConfig(), dtype=torch.float32, device="cpu")
    ours_ref.load_state_dict(hf_ref.state_dict())
    trainer = dpo_trainer(tmp_path, hf, hf_ref, trl_types, trl_weights)
    inputs = next(iter(trainer.get_train_dataloader()))
    hf.train()
    theirs = trainer.compute_loss(hf, inputs)
    theirs.backward()

    task = DpoTask.for_model(ours)
    task.settings = DpoSection(loss=loss, beta=0.1, sft_weight=sft_weight)
    task.reference = ours_ref.eval().requires_grad_(False)
    batch = packed_batch(inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"])
    ours.train()
    value, grads = ours_loss_and_grads(task, ours, batch)
    assert value == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)
    assert_grads_close(grads, hf)
    # The pair metrics TRL logs, as means over the pairs.
    logged = trainer._metrics["train"]
    for name in ("rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        ours_name = {"rewards/margins": "rewards/margin", "rewards/accuracies": "rewards/accuracy"}.get(
            name, name
        )
        assert float(task.step_metrics()[ours_name]) == pytest.approx(logged[name][-1], rel=1e-5, abs=1e-6), (
            name
        )


def test_packed_pairs_equal_separate_rows():
    """Two answers packed as segments of one sample score as the same answers packed as separate samples would:
    the attention keeps the segments apart."""
    _, ours = models()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    from veomni.models.heads.causal_lm import capture_token_log_probs

    ids = [np.asarray(tokenizer(p["prompt"] + p["chosen"])["input_ids"], dtype=np.int64) for p in PAIRS[:2]]
    trained = [np.arange(len(i)) > 2 for i in ids]
    as_pair = collate(
        [Sample(np.concatenate(ids), np.concatenate(trained), 0, media=PairSegments((len(ids[0]),)))]
    )
    as_rows = collate([Sample(ids[0], trained[0], 0), Sample(ids[1], trained[1], 1)])
    assert torch.equal(as_pair["position_ids"], as_rows["position_ids"])
    assert torch.equal(as_pair["cu_seqlens"], as_rows["cu_seqlens"])
    task = DpoTask.for_model(ours)
    results = []
    for batch in (as_pair, as_rows):
        with torch.no_grad(), capture_token_log_probs() as got:
            ours(**task.model_kwargs(batch, torch.device("cpu"), torch.ones((), dtype=torch.int64)))
        results.append(got[0][0])
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def pairs_from_cpo_batch(batch: dict) -> dict:
    """CPO/ORPO collators pad chosen and rejected separately, labels -100 outside the answer: as veomni packs them."""
    rows = []
    for side in ("chosen", "rejected"):
        for i in range(batch[f"{side}_input_ids"].shape[0]):
            keep = batch[f"{side}_attention_mask"][i].bool()
            rows.append((batch[f"{side}_input_ids"][i][keep], (batch[f"{side}_labels"][i][keep] != -100).long()))
    width = max(len(ids) for ids, _ in rows)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - len(t)))

    input_ids = torch.stack([pad(ids) for ids, _ in rows])
    attention = torch.stack([pad(torch.ones_like(ids)) for ids, _ in rows])
    completion = torch.stack([pad(mask) for _, mask in rows])
    return packed_batch(input_ids, attention, completion)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_and_gradients_equal_trl(tmp_path, loss):
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    hf, ours = models()
    common = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=len(PAIRS), report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", max_length=None, disable_dropout=True, dataloader_num_workers=0,
    )  # fmt: skip
    if loss == "simpo":
        args, trainer_cls, beta = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5, **common), CPOTrainer, 2.0
    else:
        args, trainer_cls, beta = ORPOConfig(beta=0.1, **common), ORPOTrainer, 0.1
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    trainer = trainer_cls(model=hf, args=args, train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tokenizer)
    inputs = next(iter(trainer.get_train_dataloader()))
    hf.train()
    theirs, logged = trainer.get_batch_loss_metrics(hf, inputs, train_eval="train")
    theirs.backward()

    task = DpoTask.for_model(ours)
    task.settings = DpoSection(loss=loss, beta=beta)
    ours.train()
    value, grads = ours_loss_and_grads(task, ours, pairs_from_cpo_batch(inputs))
    assert value == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)
    assert_grads_close(grads, hf)
    metrics = task.step_metrics()
    assert float(metrics["rewards/margin"]) == pytest.approx(float(logged["rewards/margins"]), rel=1e-5, abs=1e-6)
    assert float(metrics["rewards/accuracy"]) == pytest.approx(float(logged["rewards/accuracies"]), abs=1e-6)
