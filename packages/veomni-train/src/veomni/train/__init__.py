"""veomni.train: recipes, data, tasks, the training loop, checkpoints and the CLI.

The public names below are imported on first use (PEP 562), so ``import veomni.train.<module>`` imports only what
that module needs.
"""

from __future__ import annotations

from veomni.models.public_names import lazy_public_names

_PUBLIC = {
    "Recipe": "veomni.train.recipe",
    "load_recipe": "veomni.train.recipe",
    "RecipeError": "veomni.train.recipe",
    "train": "veomni.train.loop",
    "build_run": "veomni.train.loop",
    "Run": "veomni.train.loop",
    "train_step": "veomni.train.step",
    "evaluate": "veomni.train.step",
    "Task": "veomni.train.tasks",
    "TaskSetup": "veomni.train.tasks",
    "register_task": "veomni.train.tasks",
    "task_class": "veomni.train.tasks",
}

__all__, __getattr__, __dir__ = lazy_public_names(__name__, _PUBLIC)
