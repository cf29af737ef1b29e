"""A user's own task runs from a recipe with no package edit: by import path, by `register_task` name, and by an
installed package's ``veomni.tasks`` entry point (examples/custom_task/bits_task.py is the worked example)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from veomni.train.cli import main
from veomni.train.recipe import RecipeError
from veomni.train.tasks import register_task, task_class, task_names
from veomni.train.tasks.text import TextTask

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_task"
SHORT = [
    "--train.steps=2", "--train.epochs=null", "--optim.warmup_steps=1", "--train.eval_interval=null",
    "--data.eval_files=[]", "--checkpoint.hf_export=false", "--checkpoint.save_final=false", "--train.log_interval=1",
]  # fmt: skip


def test_the_worked_example_runs_from_the_cli_and_reports_bits(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    out = tmp_path / "run"
    code = main(["quickstart", "--model.task=bits_task:BitsTextTask", f"--checkpoint.dir={out}", *SHORT])
    assert code == 0, capsys.readouterr().err[-2000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The first step's loss is the quickstart's (same data, init and seed; no update yet) in bits, not nats.
    golden = json.loads((ROOT / "tests" / "golden" / "quickstart_loss.json").read_text())["loss"]
    assert losses[0] * math.log(2.0) == pytest.approx(golden[0], rel=1e-3)
    assert len(losses) == 2
    # Imported once, the module's register_task made the name available too.
    assert "text_bits" in task_names() and task_class("text_bits").__name__ == "BitsTextTask"


def test_an_entry_point_of_an_installed_package_names_a_task(tmp_path, monkeypatch):
    # A real installed distribution (a .dist-info folder on sys.path), read by importlib.metadata.
    dist = tmp_path / "site" / "my_tasks-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-tasks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[veomni.tasks]\nbits_by_entry_point = bits_task:BitsTextTask\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    assert task_class("bits_by_entry_point").__name__ == "BitsTextTask"


def test_bad_task_names_say_what_was_expected():
    with pytest.raises(ValueError, match=r"expected one of \[.*'text'.*\] or a task class as 'package.module:Class'"):
        task_class("textt")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module'"):
        task_class("no_such_module:Task")
    with pytest.raises(ValueError, match=r"veomni.train.tasks has no class 'Nope'"):
        task_class("veomni.train.tasks:Nope")
    with pytest.raises(ValueError, match=r"is not a task: it lacks \['model_task', 'data_kinds', 'prepare'"):
        task_class("pathlib:Path")


def test_a_recipe_naming_an_unknown_task_is_refused_at_parse(capsys):
    code = main(["quickstart", "--model.task=my_pkg.tasks:Reward", "--train.steps=1"])
    assert code != 0
    assert "model.task='my_pkg.tasks:Reward': cannot import 'my_pkg.tasks'" in capsys.readouterr().err


def test_register_task_refuses_taken_names_and_mismatched_names():
    with pytest.raises(ValueError, match=r"task name 'text' is already registered \(veomni.train.tasks.text:TextTask\)"):
        register_task("text")(TextTask)
    with pytest.raises(ValueError, match=r"register_task\('mine'\) on TextTask, whose name is 'text'"):
        register_task("mine")(TextTask)


def test_recipe_error_type_for_bad_tasks():
    from veomni.train.recipe.sections import ModelSection

    with pytest.raises(RecipeError, match="model.task: expected one of"):
        ModelSection(weights="x", task="nope")
