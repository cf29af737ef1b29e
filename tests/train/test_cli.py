"""The CLI surface: every shipped recipe validates, `--help` documents every field, `--print` round-trips,
errors exit 2 with the reason, and veomni-doctor reports the kernel backends."""

from __future__ import annotations

import pytest

from veomni.train.cli import main
from veomni.train.doctor import report
from veomni.train.recipe import builtin_recipes, load_recipe, recipe_fields


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_shipped_recipe_validates(name):
    recipe = load_recipe(name)
    dp = 1 if name in ("quickstart", "qwen3_0.6b", "qwen3_1.7b") else 8
    assert recipe.grad_accum(dp) >= 1


def test_help_lists_every_field(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(field in text for field in recipe_fields())
    assert "parallel.activation_checkpointing" in text


def test_print_shows_the_resolved_recipe_with_overrides(capsys):
    assert main(["quickstart", "--optim.lr=1e-4", "--print"]) == 0
    assert "lr: 0.0001" in capsys.readouterr().out


def test_a_typo_exits_2_with_a_suggestion(capsys):
    assert main(["quickstart", "--optim.lrr=1e-4"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_doctor_reports_backends_and_why_not():
    text = report()
    assert "kernel backends on" in text and "torch" in text
    assert "moe_experts" in text and "cross_entropy" in text
