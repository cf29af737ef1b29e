"""An out-of-memory step leaves a memory snapshot and one message naming the step (real CUDA OOM: the process
may use only a sliver of the GPU)."""

from __future__ import annotations

import pickle

import pytest
import torch
from test_loop import DENSE, tiny_recipe

from veomni.train.profiling import TrainingOutOfMemoryError
from veomni.train.recipe import recipe_from_dict

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_oom_step_writes_a_snapshot_and_names_the_step(tmp_path):
    from veomni.train.loop import train

    raw = tiny_recipe(str(tmp_path / "run"), DENSE, steps=2, tokens_per_step=4096, tokens_per_micro_batch=4096)
    raw["train"]["device"] = "cuda"
    raw["data"]["max_seq_len"] = 4096
    # Big enough for the model and its optimizer, far too small for a step's logits and activations.
    torch.cuda.set_per_process_memory_fraction(64 * 2**20 / torch.cuda.get_device_properties(0).total_memory)
    try:
        with pytest.raises(TrainingOutOfMemoryError, match=r"step \d+ ran out of memory on rank 0") as info:
            train(recipe_from_dict(raw))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    snapshot = tmp_path / "run" / "oom_rank_0.pickle"
    assert str(snapshot) in str(info.value)
    assert "segments" in pickle.loads(snapshot.read_bytes())
    assert "PyTorch CUDA memory summary" in (tmp_path / "run" / "oom_rank_0.txt").read_text()
