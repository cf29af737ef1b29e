"""Real-world smoke test: an empty config over Qwen3 reproduces upstream behaviour bitwise on CPU."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers_patchgen import import_file
from patchgen.codegen import generate
from patchgen.config import PatchConfig
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3


def test_empty_qwen3_config_matches_upstream_bitwise(tmp_path: Path) -> None:
    cfg = PatchConfig("transformers.models.qwen3.modeling_qwen3", "patched_modeling_qwen3.py", "smoke")
    gen = generate(cfg)
    path = tmp_path / cfg.target_file
    path.write_text(gen.code)
    patched = import_file(path, "patchgen_test_patched_modeling_qwen3")
    assert patched.Qwen3ForCausalLM is not modeling_qwen3.Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = modeling_qwen3.Qwen3ForCausalLM(config).eval()
    ours = patched.Qwen3ForCausalLM(config).eval()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        got = ours(input_ids=ids).logits
    assert torch.equal(expected, got)
