"""Patches Qwen3-VL-MoE's upstream modeling: everything Qwen3-VL's adapter does, plus routed experts on veomni's
kernels, the load-balancing loss read from ``text_config`` and the expert-parallel plan.

Reused from `veomni.models.qwen3_vl.patch_config` through ``name_map({"Qwen3VL": "Qwen3VLMoe"})`` (the two
upstream modules are structural duplicates apart from the MoE block): the text RMSNorm / dense MLP / attention on
the instance's kernels, the deepstack add without host syncs, the vision attention on the encoder varlen entry, the
vision forward (ViT Ulysses SP), the tower's ``dummy_forward``, ``Qwen3VLMoeModel.__init__`` (patched sub-models)
and ``Qwen3VLMoeModel.forward`` (one tower pass, SP scatter). The last one returns the language model's output
object as is (no dense output dataclass is constructed), so the MoE ``router_logits`` survive the rename.

Written here: ``Qwen3VLMoeForConditionalGeneration.__init__`` (exposes ``num_experts``, ``num_experts_per_tok`` and
``router_aux_loss_coef`` of ``text_config`` as attributes, where `veomni.models.heads.causal_lm.router_aux_loss` and the
trainer look for them), its ``forward`` (fused LM loss + router aux loss) and ``get_parallel_plan`` on it and on
``Qwen3VLMoeModel``. The experts (``Qwen3VLMoeTextExperts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
in memory, HF's default layout) are not patched: HF's experts interface dispatches them to ``"veomni"``
(`veomni.models.hf.experts`). Checkpoints store them transposed; transformers' ``qwen3_vl_moe`` conversion recipe
(``Transpose(1, 2)``) is applied on load and reverted on export by `veomni.models.convert.recipes`.
Regenerate with ``uv run patchgen veomni.models.qwen3_vl_moe.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from torch import nn
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    BaseModelOutputWithPooling,
    Cache,
    MoeCausalLMOutputWithPast,
    Qwen3VLMoeConfig,
    Qwen3VLMoeModel,
    TransformersKwargs,
    Unpack,
    load_balancing_loss_func,
)

from veomni.core.ep import ExpertPlan
from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3_vl import patch_config as dense

config = PatchConfig(
    source_module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    target_file="patched_modeling_qwen3_vl_moe.py",
    description="Qwen3-VL-MoE: the Qwen3-VL adapter's text kernels, encoder varlen vision tower, ViT SP and dummy "
    "forward (reused via name_map), routed experts through veomni's experts interface, the load-balancing loss "
    "from text_config, and get_parallel_plan() for expert parallelism",
)
upstream_checkpoint_io(config, "Qwen3VLMoePreTrainedModel")
use_veomni_masks(config, "create_causal_mask")
config.name_map({"Qwen3VL": "Qwen3VLMoe"}, origin_module="transformers.models.qwen3_vl.modeling_qwen3_vl")
for statement in dense.config.imports:
    config.add_import(statement)
config.add_import("from veomni.models.heads.causal_lm import router_aux_loss")
config.add_import("from veomni.core.ep import ExpertPlan")

_REUSED = (
    ("Qwen3VLMoeTextRMSNorm.forward", dense.rms_norm_forward, "RMSNorm via kernels.get('rms_norm', 'standard')"),
    ("Qwen3VLMoeTextMLP.forward", dense.mlp_forward, "SwiGLU via kernels.get('swiglu', 'standard') (dense layers)"),
    ("Qwen3VLMoeTextAttention.forward", dense.text_attention_forward, "RoPE via kernels.get('rope', 'full')"),
    ("Qwen3VLMoeTextModel._deepstack_process", dense.deepstack_process, "deepstack add as a gather + where"),
    ("Qwen3VLMoeVisionAttention.forward", dense.vision_attention_forward,
     "veomni_* implementations: encoder_attention on the packed tokens and the tower's cu_seqlens"),
    ("Qwen3VLMoeVisionModel.forward", dense.vision_forward,
     "rotary positions and position-embedding taps without host syncs; ViT Ulysses SP"),
    ("Qwen3VLMoeVisionModel.dummy_forward", dense.vision_dummy_forward,
     "injected: the tower on one all-zero merged token, for ranks without image or video"),
    ("Qwen3VLMoeModel.__init__", dense.model_init, "build the patched vision and text sub-models"),
    ("Qwen3VLMoeModel.forward", dense.model_forward,
     "one tower pass, features scattered without host syncs, dummy tower forward, Ulysses SP slices; returns the "
     "language model's MoE output (router_logits included) unchanged"),
)  # fmt: skip
for target, function, description in _REUSED:
    config.override_method(target, description=f"{description} (Qwen3-VL adapter, renamed)")(function)


@config.override_method(
    "Qwen3VLMoeForConditionalGeneration.__init__",
    description="the MoE settings of text_config as attributes: router_aux_loss reads num_experts / "
    "num_experts_per_tok there, and the trainer zeroes router_aux_loss_coef there to add the aux term itself",
)
def conditional_generation_init(self, config: Qwen3VLMoeConfig):
    super().__init__(config)
    self.model = Qwen3VLMoeModel(config)
    self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
    text_config = config.text_config
    self.num_experts = text_config.num_experts
    self.num_experts_per_tok = text_config.num_experts_per_tok
    self.router_aux_loss_coef = text_config.router_aux_loss_coef

    self.post_init()


@config.override_method(
    "Qwen3VLMoeForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy: no [T, V] logits); aux loss "
    "via router_aux_loss (load_balancing_loss kernel, SP-global statistics, None without router logits) scaled by "
    "self.router_aux_loss_coef",
)
def conditional_generation_forward(
    self,
    input_ids: torch.LongTensor = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    mm_token_type_ids: torch.IntTensor | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | MoeCausalLMOutputWithPast:
    output_router_logits = (
        output_router_logits
        if output_router_logits is not None
        else self.config.text_config.output_router_logits
    )
    outputs = self.model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        mm_token_type_ids=mm_token_type_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        mm_encoder_outputs=mm_encoder_outputs,
        output_router_logits=output_router_logits,
        **kwargs,
    )
    logits, loss = lm_logits_and_loss(self, outputs[0], labels, logits_to_keep, **kwargs)

    aux_loss = None
    if output_router_logits:
        aux_loss = router_aux_loss(self, outputs.router_logits, attention_mask, load_balancing_loss_func)
        if loss is not None and aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)

    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )


@config.override_method(
    "Qwen3VLMoeForConditionalGeneration.get_parallel_plan",
    description="expert parallelism: the language model's fused expert tensors, sharded on dim 0 (experts)",
)
def get_parallel_plan(self) -> ExpertPlan:
    """FQN globs, relative to this model, of the ``[E, ...]`` expert tensors that EP shards on dim 0."""
    return ExpertPlan(
        patterns=(
            "model.language_model.layers.*.mlp.experts.gate_up_proj",
            "model.language_model.layers.*.mlp.experts.down_proj",
        )
    )


@config.override_method(
    "Qwen3VLMoeModel.get_parallel_plan",
    description="expert parallelism for the base model: the language model's fused expert tensors on dim 0",
)
def model_parallel_plan(self) -> ExpertPlan:
    """FQN globs, relative to this model, of the ``[E, ...]`` expert tensors that EP shards on dim 0."""
    return ExpertPlan(
        patterns=(
            "language_model.layers.*.mlp.experts.gate_up_proj",
            "language_model.layers.*.mlp.experts.down_proj",
        )
    )
