"""Hand-written pieces of the Qwen3-Omni-MoE thinker adapter that the generated modeling file calls.

The audio tower's token rule (three stride-2 convolutions per ``2 * n_window``-frame chunk; upstream's formula
hard-codes the 13 tokens of a full 100-frame chunk, so it holds only for ``n_window == 50``) and the talker
refusal. The dummy inputs of both towers and the placeholder check are Qwen2.5-Omni's and Qwen3-VL's
(`veomni.models.qwen2_5_omni.towers`, `veomni.models.qwen3_vl.vision`).
"""

from __future__ import annotations

import torch

TALKER_REFUSAL = (
    "veomni trains the Qwen3-Omni-MoE thinker only (text out): the talker, its code predictor and code2wav (speech "
    "generation) are not built and their checkpoint weights are ignored and reported at load. Use transformers' "
    "Qwen3OmniMoeForConditionalGeneration on the exported thinker plus the original talker and code2wav weights "
    "for speech"
)

# Upstream's _get_feat_extract_output_lengths adds 13 tokens per full chunk: the output of three stride-2
# convolutions on 100 frames, i.e. n_window = 50. Any other window would index past the conv output.
SUPPORTED_N_WINDOW = 50


def check_audio_window(n_window: int) -> None:
    """Refuse an audio config whose chunk size upstream's token rule cannot describe.

    Args:
        n_window: the audio config's ``n_window`` (chunks are ``2 * n_window`` mel frames).
    """
    if n_window != SUPPORTED_N_WINDOW:
        raise ValueError(
            f"Qwen3-Omni-MoE audio tower: audio_config.n_window must be {SUPPORTED_N_WINDOW} (transformers' token "
            f"rule counts 13 tokens per full {2 * SUPPORTED_N_WINDOW}-frame chunk); found {n_window}"
        )


def audio_token_count(frames: int | torch.Tensor) -> int | torch.Tensor:
    """LLM tokens of a clip of ``frames`` mel frames: 13 per full 100-frame chunk, plus the three stride-2
    convolutions' output on the remainder (transformers' ``_get_feat_extract_output_lengths`` for n_window 50).

    Args:
        frames: an int or an int64 tensor of any shape (frames per clip).
    Returns:
        the same type and shape, tokens per clip.
    """
    chunk = 2 * SUPPORTED_N_WINDOW
    rest = frames % chunk
    after = (rest - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13
