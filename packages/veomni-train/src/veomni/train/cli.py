"""``veomni-train RECIPE [--section.field=value ...]``: one process, or every rank under ``torchrun``.

RECIPE is a YAML file or a built-in recipe name (``quickstart``). ``--help`` lists every recipe field with its
default and meaning; ``--print`` shows the resolved recipe and exits.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

# Only the standard library at import time: importing torch (through the recipe module) takes seconds, and a Ctrl-C
# in those seconds must end in `main`'s one line, not in a traceback from the import machinery.
if TYPE_CHECKING:
    from veomni.train.rank_failure import FailureWatch
    from veomni.train.recipe import Recipe

CONSOLE_LOGGER = "veomni.train.console"
"""The logger `veomni.train.run_log.attach_log_file` gives the log file's handler: the console lines and the CLI's
last line reach the file through it (and nowhere else: it does not propagate)."""


def _usage() -> str:
    from veomni.train.recipe import builtin_recipes

    return (
        "usage: veomni-train RECIPE [--section.field=value ...] [--print]\n"
        "       torchrun --nproc-per-node N -m veomni.train.cli RECIPE [...]\n"
        f"RECIPE: a YAML file or one of the built-in recipes: {', '.join(builtin_recipes())}\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``veomni-train`` with ``argv`` (default: the command line); returns the exit status."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before training began (torch and the model code are still being imported) or after it ended:
        # nothing is half-written, so one line and the shell's usual status for SIGINT.
        print("veomni-train: interrupted: stopped at once", file=sys.stderr, flush=True)
        return 130


def _main(argv: list[str] | None) -> int:
    from veomni.train.recipe import RecipeError, dump_recipe, load_recipe, recipe_help

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or "--help" in args or "-h" in args:
        print(_usage() + "\nrecipe fields:\n" + recipe_help())
        return 0 if args else 2
    show = "--print" in args
    args = [a for a in args if a != "--print"]
    if not args or args[0].startswith("--"):
        print(f"veomni-train: the recipe comes first (a name or a YAML path), found {args[:1] or 'none'}\n" + _usage(),
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        recipe = load_recipe(args[0], args[1:])
    except (RecipeError, FileNotFoundError) as err:
        print(f"veomni-train: {err}", file=sys.stderr)
        return 2
    if show:
        print(dump_recipe(recipe))
        return 0
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not sys.stderr.isatty():
        _quiet_third_party_bars()
    if not recipe.log.file:
        return _train(recipe, rank)
    from veomni.train.run_log import attach_log_file, detach_log_file

    # log.file: auto is train.log beside the checkpoints.
    path = os.path.join(recipe.checkpoint.dir, "train.log") if recipe.log.file == "auto" else recipe.log.file
    handler = attach_log_file(path, rank)
    try:
        return _train(recipe, rank)
    finally:
        detach_log_file(handler)  # an embedding program (or a test) may call main again


def _tell(line: str, *, level: int = logging.ERROR, stream: TextIO | None = None) -> None:
    """Print ``line`` (to stderr unless ``stream``) and copy it to ``log.file`` when one is attached: the file then
    ends as the terminal does, with the line that says how the run ended."""
    print(line, file=sys.stderr if stream is None else stream, flush=True)
    console = logging.getLogger(CONSOLE_LOGGER)
    if console.handlers:
        console.log(level, line)


def _train(recipe: Recipe, rank: int) -> int:
    """Train ``recipe`` on this rank; every way it ends is one line (`_tell`) and an exit status."""
    # Heavy imports only when training.
    from veomni.models.loading import CheckpointFileError
    from veomni.train.checkpoint.match import CheckpointMismatchError
    from veomni.train.data.sources import DataError
    from veomni.train.loop import train
    from veomni.train.numerics import TrainingDivergedError
    from veomni.train.preflight import PreflightError
    from veomni.train.profiling import TrainingOutOfMemoryError
    from veomni.train.rank_failure import FailureWatch, peer_failure, stop_process
    from veomni.train.stop_signals import TrainingStopped

    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # Another rank's failure stops this one with one line (veomni.train.rank_failure), wherever it is blocked.
    watch = FailureWatch(rank).start() if multi else None
    try:
        result = train(recipe)
    except TrainingStopped as stopped:
        _stop_watch(watch, rank, None)
        if rank == 0:
            _tell(f"veomni-train: {stopped}", level=logging.WARNING)
        _close_process_group()
        return stopped.exit_code
    except KeyboardInterrupt:
        # Asked twice (or before the loop began): nothing more is written; a save cut short has no COMPLETE
        # marker, so resume=auto skips it. The process group is left alone: a peer may be gone already.
        _stop_watch(watch, rank, None)
        _tell("veomni-train: interrupted: stopped at once, nothing saved for the current step")
        return 130
    except (PreflightError, DataError, CheckpointMismatchError, CheckpointFileError) as err:
        # Bad input, explained by the message itself: no traceback to wade through.
        where = f" (rank {rank})" if multi else ""
        _tell(f"veomni-train{where}: {type(err).__name__}: {err}")
        _stop_watch(watch, rank, err)
        _close_process_group()
        return 2
    except TrainingOutOfMemoryError as err:
        # Each rank that ran out says so (ranks differ: uneven rows, EP); the snapshot names what held the memory.
        _tell(f"veomni-train (rank {rank}): {type(err).__name__}: {err}")
        _stop_watch(watch, rank, err)
        return 1
    except TrainingDivergedError as err:
        # The message names the step, its numbers and the checkpoint to go back to.
        _stop_watch(watch, rank, None)
        if rank == 0:
            _tell(f"veomni-train: {type(err).__name__}: {err}")
        _close_process_group()
        return 1
    except Exception as err:
        # A collective failing because another rank stopped (gloo: "Connection closed by peer") is that rank's
        # failure, told in one line; anything else is this rank's own, told to the others and raised.
        failure = peer_failure(rank) if multi else None
        if failure is not None:
            _stop_watch(watch, rank, None)
            stop_process(rank, failure)  # exits 2
        _stop_watch(watch, rank, err)
        if logging.getLogger(CONSOLE_LOGGER).handlers:  # the traceback goes to stderr as Python prints it
            logging.getLogger(CONSOLE_LOGGER).error("veomni-train: failed", exc_info=True)
        raise
    _stop_watch(watch, rank, None)
    if rank == 0:
        losses = result["loss"]
        if losses:
            _tell(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", level=logging.INFO,
                  stream=sys.stdout)  # fmt: skip
        for path in result["exports"]:
            _tell(f"HF export: {path}", level=logging.INFO, stream=sys.stdout)
    _close_process_group()
    return 0


def _quiet_third_party_bars() -> None:
    # Redirected output: transformers', the Hub's and datasets' tqdm bars would redraw with carriage returns into
    # the log. The variables reach the data loader's worker processes too, and are read when those libraries are
    # first imported (after this); a value the user set is kept.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()


def _stop_watch(watch: FailureWatch | None, rank: int, error: BaseException | None) -> None:
    """Stop this rank's `FailureWatch` and, when it failed with ``error``, tell the other ranks."""
    from veomni.train.rank_failure import publish_failure

    if watch is not None:
        watch.stop()
        if error is not None:
            publish_failure(rank, error)


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
