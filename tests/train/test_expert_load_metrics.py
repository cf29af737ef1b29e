"""The trainer reports how evenly MoE routers spread tokens (veomni.models.moe.expert_load): one record per log window
in metrics.jsonl and the worst layer's max/mean load on the console line."""

from __future__ import annotations

import json

from test_loop import MOE, tiny_recipe

from veomni.train.cli import main
from veomni.train.recipe import recipe_from_dict, save_recipe


def test_the_trainer_reports_expert_load_per_log_window(tmp_path, capsys):
    raw = tiny_recipe(str(tmp_path / "run"), MOE, steps=2)
    path = save_recipe(recipe_from_dict(raw), tmp_path / "moe.yaml")
    assert main([str(path), "--checkpoint.hf_export=false"]) == 0
    assert "moe max/mean " in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    moe = [r for r in records if "moe_imbalance" in r]
    assert [r["step"] for r in moe] == [1, 2]  # one per log window (log_interval 1)
    for r in moe:
        assert len(r["moe_imbalance_per_layer"]) == MOE["num_hidden_layers"]
        assert 1.0 <= r["moe_imbalance"] <= MOE["num_experts"] and round(r["moe_imbalance"], 4) == max(r["moe_imbalance_per_layer"])
