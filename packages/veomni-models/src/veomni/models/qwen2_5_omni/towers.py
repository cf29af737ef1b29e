"""Hand-written pieces of the Qwen2.5-Omni thinker adapter that the generated modeling file calls.

The dummy input of the audio tower (ranks whose micro-batch lacks a modality still run the tower,
so FSDP's collectives match across ranks), the audio placeholder check upstream skips (``masked_scatter``
silently takes the first rows when counts differ) and the talker refusal.
"""

from __future__ import annotations

import torch

TALKER_REFUSAL = (
    "veomni trains the Qwen2.5-Omni thinker only (text out): the talker and token2wav (speech generation) are "
    "not built and their checkpoint weights are ignored and reported at load. Use transformers' "
    "Qwen2_5OmniForConditionalGeneration on the exported thinker plus the original talker weights for speech."
)

# Mel frames of the audio dummy: conv2 (stride 2) turns 4 frames into 2, the stride-2 pooler those into 1 token.
_DUMMY_AUDIO_FRAMES = 4


def dummy_audio_inputs(num_mel_bins: int, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest valid audio-tower input: one clip of 4 zero mel frames.

    Args:
        num_mel_bins: the tower's ``config.num_mel_bins``.
        weight: a live tower weight; the dummy takes its dtype and device (never cached).
    Returns:
        ``(input_features [num_mel_bins, 4] in weight's dtype, feature_lens int64 [1] = [4])``.
    """
    features = torch.zeros(num_mel_bins, _DUMMY_AUDIO_FRAMES, dtype=weight.dtype, device=weight.device)
    return features, torch.tensor([_DUMMY_AUDIO_FRAMES], dtype=torch.long, device=weight.device)


def check_placeholder_count(modality: str, mask: torch.Tensor, features: torch.Tensor) -> None:
    """`check_placeholder_counts` for one modality."""
    check_placeholder_counts({modality: mask}, {modality: features})


def check_placeholder_counts(masks: dict[str, torch.Tensor], features: dict[str, torch.Tensor]) -> None:
    """Raise if any modality's placeholder tokens differ in number from its feature rows.

    Upstream checks images and videos but not audio: its ``masked_scatter`` then silently uses a prefix. The counts
    of every modality are read back together: one host sync per forward, not one per modality.

    Args:
        masks: per modality (``"audio"``, ``"image"``, ``"video"``), ``[B, S]`` bool, True at its placeholders.
        features: per modality, ``[N, H]`` the tower's output for every item of the micro-batch.
    """
    names = list(features)
    counts = torch.stack([masks[name].sum() for name in names]).tolist()
    for name, tokens in zip(names, counts, strict=True):
        if tokens != features[name].shape[0]:
            raise ValueError(
                f"{name} placeholder tokens and {name} features differ: {tokens} tokens in input_ids, "
                f"{features[name].shape[0]} feature rows from the {name} tower (the processor expands each item "
                "to its feature length; was the text tokenized without the processor, or truncated?)"
            )


def check_thinker_sp_inputs(
    input_ids: torch.Tensor | None, position_ids: torch.Tensor | None, world: int
) -> None:
    """Refuse inputs the thinker cannot run under Ulysses SP, saying what is expected.

    Args:
        input_ids: this rank's ``[B, S_local]`` slice (placeholders are found by id, so it is required).
        position_ids: this rank's slice ``[3, B, S_local]`` of the mrope ids computed on the full sequence, or
            ``[4, B, S_local]`` with the text positions first (transformers' packed layout, as the trainer's
            collator writes it: the text model reads row 0 for packed masks).
        world: the SP group size.
    """
    if input_ids is None:
        raise ValueError(f"the Qwen2.5-Omni thinker under sequence parallelism (sp={world}) needs input_ids")
    if position_ids is None or position_ids.dim() != 3 or position_ids.shape[0] not in (3, 4):
        found = None if position_ids is None else tuple(position_ids.shape)
        raise ValueError(
            f"the Qwen2.5-Omni thinker under sequence parallelism (sp={world}) needs position_ids [3 or 4, batch, "
            f"local_seq_len]: this rank's slice of the mrope ids computed on the full sequence (a slice cannot "
            f"rebuild them; veomni.models.qwen2_5_omni.positions computes them on the host); found {found}"
        )
