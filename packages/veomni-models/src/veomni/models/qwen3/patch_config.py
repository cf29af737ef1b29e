"""Patches Qwen3's upstream modeling so that RMSNorm, SwiGLU, RoPE and the LM loss dispatch through the instance's kernels.

Every patched forward keeps the upstream code as its ``eager`` branch, so a model without attached kernels (or
with an op set to ``eager``) computes exactly what transformers computes. Regenerate with
``uv run patchgen veomni.models.qwen3.patch_config``.
"""

from __future__ import annotations

import textwrap

import torch
from patchgen.config import PatchConfig
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    Qwen3Config,
    Qwen3Model,
    TransformersKwargs,
    Unpack,
)

from veomni.models.heads.causal_lm import lm_logits_and_loss
from veomni.models.heads.seq_cls import init_sequence_classifier, seq_cls_forward
from veomni.models.heads.token_heads import (
    init_question_answering,
    init_token_classifier,
    qa_forward,
    token_cls_forward,
)
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io

config = PatchConfig(
    source_module="transformers.models.qwen3.modeling_qwen3",
    target_file="patched_modeling_qwen3.py",
    description="Qwen3 with RMSNorm, SwiGLU and RoPE dispatched through veomni's per-instance kernel set",
)
upstream_checkpoint_io(config, "Qwen3PreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.add_import("from veomni.models.hf.async_sp import async_sp_attention, async_ulysses_active")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")


@config.override_method("Qwen3RMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard')")
def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.rms_norm != "eager":
        # Same maths as below: normalise in fp32, cast to the input dtype, then scale by the weight.
        return kernels.get("rms_norm", "standard")(hidden_states, self.weight, self.variance_epsilon)
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


@config.override_method("Qwen3MLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")
def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.swiglu != "eager":
        if self.config.hidden_act != "silu":
            raise ValueError(
                f"OpsConfig.swiglu={kernels.config.swiglu!r} computes silu(gate) * up, but this model's "
                f"hidden_act is {self.config.hidden_act!r}; set swiglu='eager'"
            )
        return self.down_proj(kernels.get("swiglu", "standard")(self.gate_proj(x), self.up_proj(x)))
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


ROPE = "RoPE via kernels.get('rope', 'full')"


def rope_via_kernels(patch_config: PatchConfig, attention: str, description: str = ROPE) -> None:
    """Route the one ``apply_rotary_pos_emb`` call of upstream's ``<attention>.forward`` through ``apply_rope``
    (the instance's ``rope/full`` kernel; upstream's function is the eager fallback)."""
    patch_config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
    patch_config.replace_call(
        f"{attention}.forward",
        "apply_rotary_pos_emb",
        "apply_rope(self, __args__, apply_rotary_pos_emb)",
        description=description,
    )


# parallel.async_ulysses: V's exchange starts while Q and K are projected, normed and rotated. __PROJECT_QK__ is
# the family's code binding q and k ([B, H, S/P, D]) from x; __WINDOW__ hands the module's sliding window on.
ASYNC_ULYSSES = """
if async_ulysses_active(self, past_key_values):
    # parallel.async_ulysses: V's exchange starts while Q and K are projected, normed and rotated.
    def project(x):
        yield "v", self.v_proj(x).view(hidden_shape)
__PROJECT_QK__
        yield "q", q.transpose(1, 2)
        yield "k", k.transpose(1, 2)

    attn_output = async_sp_attention(
        self, hidden_states, project, attention_mask, query_heads=self.config.num_attention_heads,
        scaling=self.scaling,__WINDOW__
        dropout=0.0 if not self.training else self.attention_dropout, **kwargs,
    )  # fmt: skip
    return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), None
"""
# Qwen3's Q and K: per-head norms (over the last dim, so before the head transpose as upstream), full RoPE.
NORMED_QK = """
q = self.q_norm(self.q_proj(x).view(hidden_shape)).transpose(1, 2)
k = self.k_norm(self.k_proj(x).view(hidden_shape)).transpose(1, 2)
q, k = apply_rope(self, q, k, *position_embeddings, apply_rotary_pos_emb)
"""
QWEN3_ANCHOR = "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"


def async_ulysses_branch(
    patch_config: PatchConfig, attention: str, anchor: str, *, project_qk: str = NORMED_QK,
    sliding_window: bool = True,
) -> None:  # fmt: skip
    """Insert before ``anchor`` (the first projection statement of upstream's ``<attention>.forward``) the branch
    taken under ``parallel.async_ulysses`` (veomni.models.hf.async_sp): a generator yields V, then Q and K as the
    code ``project_qk`` makes them from ``x``, and each one's exchange starts as soon as it exists.

    Args:
        project_qk: statements binding ``q`` and ``k`` ``[B, H, S/P, D]`` (normed and rotated on local positions)
            from ``x`` ``[B, S/P, hidden]``, with ``hidden_shape`` and ``position_embeddings`` in scope.
        sliding_window: the module has ``self.sliding_window`` and upstream hands it to the attention function.
    """
    patch_config.add_import("from veomni.models.hf.async_sp import async_sp_attention, async_ulysses_active")
    project = textwrap.indent(textwrap.dedent(project_qk).strip("\n"), " " * 8)  # the generator's body
    code = ASYNC_ULYSSES.replace("__PROJECT_QK__", project)
    code = code.replace("__WINDOW__", " sliding_window=self.sliding_window," if sliding_window else "")
    patch_config.insert_before(
        f"{attention}.forward",
        anchor,
        code,
        description="under parallel.async_ulysses the projections overlap the Ulysses exchange "
        "(veomni.models.hf.async_sp)",
    )


def qwen3_attention(
    patch_config: PatchConfig, attention: str, *, anchor: str = QWEN3_ANCHOR, rope: str = ROPE
) -> None:
    """Qwen3-style attention (q/k norms): RoPE via the kernel set (``rope``: its description), and under
    ``parallel.async_ulysses`` the projections overlapping the Ulysses exchange (veomni.models.hf.async_sp),
    branched off before ``anchor``, upstream's first projection statement."""
    rope_via_kernels(patch_config, attention, rope)
    async_ulysses_branch(patch_config, attention, anchor)


qwen3_attention(config, "Qwen3Attention")


@config.override_method(
    "Qwen3ForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss: a fused linear cross-entropy gets the hidden states and "
    "the LM-head weight (no [T, V] logits); eager runs the upstream head and loss",
)
def causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> CausalLMOutputWithPast:
    outputs: BaseModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    # logits_to_keep is applied before the loss; with a fused loss, logits stay None (never materialised).
    logits, loss = lm_logits_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


# Sequence classification. The decoder inside the classifier is this module's patched Qwen3Model (upstream's
# __init__ builds transformers' own through AutoModel, which no kernel, SP or EP path reaches); the classification
# CE goes through the kernel registry (veomni.models.heads.seq_cls). Other families reuse both functions, the __init__
# with name_map={"Qwen3": "<Prefix>"}.
config.add_import(
    "from veomni.models.heads.seq_cls import init_sequence_classifier, sequence_classification_forward"
)
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
SEQ_CLS_INIT = (
    "build this module's patched base model (upstream's AutoModel.from_config builds transformers' own)"
)
SEQ_CLS_FORWARD = "classification CE via kernels.get('cross_entropy', 'seq_cls') on the pooled hidden states"


@config.add_method("Qwen3ForSequenceClassification.__init__", description=SEQ_CLS_INIT)
def seq_cls_init(self, config: Qwen3Config) -> None:
    init_sequence_classifier(self, config, Qwen3Model)


config.add_method("Qwen3ForSequenceClassification.forward", description=SEQ_CLS_FORWARD)(seq_cls_forward)


# Token classification and question answering: the decoder inside is this module's patched Qwen3Model (upstream's
# __init__ builds transformers' own through AutoModel); the forwards are upstream's, with Ulysses SP
# (veomni.models.heads.token_heads). Other families call add_token_heads with their class prefix.
TOKEN_HEADS_INIT = SEQ_CLS_INIT


def token_cls_init(self, config: Qwen3Config) -> None:
    init_token_classifier(self, config, Qwen3Model)


def qa_init(self, config: Qwen3Config) -> None:
    init_question_answering(self, config, Qwen3Model)


def add_token_heads(patch_config: PatchConfig, prefix: str, *, question_answering: bool = True) -> None:
    """Patch ``<prefix>ForTokenClassification`` (and ``<prefix>ForQuestionAnswering``) of a family's config.

    Args:
        patch_config: the family's ``PatchConfig``.
        prefix: the family's class prefix (``"Llama"``, ``"Qwen3Moe"``, ...); ``Qwen3`` in the injected code is
            renamed to it.
        question_answering: whether the family has a question-answering head upstream.
    """
    names = None if prefix == "Qwen3" else {"Qwen3": prefix}
    patch_config.add_import("from veomni.models.heads.token_heads import init_token_classifier")
    patch_config.add_import("from veomni.models.heads.token_heads import token_classification_forward")
    patch_config.add_import("from transformers.modeling_outputs import TokenClassifierOutput")
    patch_config.add_method(
        f"{prefix}ForTokenClassification.__init__", description=TOKEN_HEADS_INIT, name_map=names
    )(token_cls_init)
    patch_config.add_method(
        f"{prefix}ForTokenClassification.forward",
        description="upstream's forward; under Ulysses SP the shard's loss over the whole sequence's valid tokens",
    )(token_cls_forward)
    if not question_answering:
        return
    patch_config.add_import("from veomni.models.heads.token_heads import init_question_answering")
    patch_config.add_import("from veomni.models.heads.token_heads import question_answering_forward")
    patch_config.add_import("from transformers.modeling_outputs import QuestionAnsweringModelOutput")
    patch_config.add_method(
        f"{prefix}ForQuestionAnswering.__init__", description=TOKEN_HEADS_INIT, name_map=names
    )(qa_init)
    patch_config.add_method(
        f"{prefix}ForQuestionAnswering.forward",
        description="upstream's forward; under Ulysses SP the span logits gathered over the SP group",
    )(qa_forward)


add_token_heads(config, "Qwen3")
