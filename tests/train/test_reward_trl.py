"""The reward task equals TRL's ``RewardTrainer`` on the same tokens (loss, gradients, accuracy and margin), trains
through the CLI from a causal-LM checkpoint (the head starts at zero), keeps SP=2 equal to one rank, and exports a
model that ``AutoModelForSequenceClassification`` loads and scores alike."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_dpo_train import TOKENIZER, base, dpo_recipe  # noqa: F401 (base: a fixture)
from test_dpo_trl import PAIRS as TEXT_PAIRS
from test_dpo_trl import tiny_config
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.train.data import Step
from veomni.train.data.encode import Sample
from veomni.train.data.packing import collate
from veomni.train.data.pairs import PairSegments
from veomni.train.tasks.reward import RewardTask

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")


def reward_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config()
    config.num_labels = 1
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = build_model(config, ops=OpsConfig(), dtype=torch.float32, device="cpu", task="sequence_classification")
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_loss_gradients_and_metrics_equal_trl(tmp_path):
    from trl import RewardConfig, RewardTrainer

    hf, ours = reward_models()
    args = RewardConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=len(TEXT_PAIRS), report_to=[], use_cpu=True,
        bf16=False, save_strategy="no", max_length=None, disable_dropout=True, dataloader_num_workers=0,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    trainer = RewardTrainer(
        model=hf, args=args, train_dataset=datasets.Dataset.from_list(TEXT_PAIRS), processing_class=tokenizer
    )
    inputs = next(iter(trainer.get_train_dataloader()))
    hf.train()
    theirs = trainer.compute_loss(hf, inputs)
    theirs.backward()

    pairs = inputs["input_ids"].shape[0] // 2
    samples = []
    for i in range(pairs):
        parts = [inputs["input_ids"][row][inputs["attention_mask"][row].bool()].numpy() for row in (i, pairs + i)]
        ids = np.concatenate(parts).astype(np.int64)
        trained = np.ones(len(ids), dtype=bool)
        trained[[0, len(parts[0])]] = False
        samples.append(Sample(ids, trained, i, media=PairSegments((len(parts[0]),))))
    batch = collate(samples)
    task = RewardTask.for_model(ours)
    step = Step(step=0, epoch=0, micro_batches=[batch], tokens=0, valid_tokens=1)
    num_items = task.step_normaliser(step, torch.device("cpu"))
    ours.train()
    loss, objective = task.loss(task.forward(ours, batch, torch.device("cpu"), num_items), 1.0)
    objective.backward()
    assert float(loss) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(dict(ours.named_parameters())[name].grad, p.grad, rtol=2e-4, atol=2e-6, msg=name)
    logged = trainer._metrics["train"]
    assert float(task.step_metrics()["rewards/accuracy"]) == pytest.approx(logged["accuracy"][-1], abs=1e-6)
    assert float(task.step_metrics()["rewards/margin"]) == pytest.approx(logged["margin"][-1], rel=1e-5, abs=1e-6)


def _steps(ctx, raw: dict, n: int) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    stats = [train_step(run, next(it)) for _ in range(n)]
    return {"losses": [s["loss"] for s in stats], "accuracy": [s["rewards/accuracy"] for s in stats]}


def reward_recipe(weights: str, ckpt: str, **sections) -> dict:
    raw = dpo_recipe(weights, ckpt, **sections)
    raw["model"]["task"] = "reward"
    return raw


def test_from_a_causal_lm_the_head_starts_at_zero_and_sp2_matches(dist_pools, base, tmp_path):  # noqa: F811
    one = dist_pools.get(1, "gloo").run(_steps, reward_recipe(base, str(tmp_path / "one")), 3)[0]
    assert one["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # every reward 0 at the start
    assert one["losses"][-1] < one["losses"][0], one
    for got in dist_pools.get(2, "gloo").run(_steps, reward_recipe(base, str(tmp_path / "sp"), parallel={"sp": 2}), 3):
        assert got["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-5), (got, one)


@pytest.mark.slow
def test_cli_run_exports_a_sequence_classifier(base, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "veomni.train.cli", "quickstart_reward",
        f"--model.weights={base}", f"--model.tokenizer={TOKENIZER}", f"--checkpoint.dir={out}", "--train.steps=4",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    assert model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    ids = tokenizer("What is 2 + 3? 2 + 3 = 5.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, 1)
    # The checkpoint was a causal LM: its LM head is not in the reward model.
    assert AutoModelForCausalLM is not None and not hasattr(model, "lm_head")
