"""LoRA contenders of `bench_lora` (T13): veomni's LoRA (eager or compiled blocks) and HF transformers + PEFT
(optionally with Liger), each on the same saved bf16 base, r/alpha/targets equal, fused AdamW on the adapters.

Every contender follows `e2e_contenders.Contender`: ``step(micro_batches, num_items) -> (loss, grad_norm)``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from e2e_contenders import LIGER_PATCHES, Contender, Settings, _ops, _ops_info

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.compile import compile_stats
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.models.build import build_model, default_fsdp_policy
from veomni.models.lora import LoraSpec
from veomni.train.data import model_inputs
from veomni.train.optim import build_adamw, clip_and_step

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""All linear layers of a Qwen3 decoder (the lm_head is not adapted: BENCHMARKS.md's T13)."""


class VeomniLora(Contender):
    """What ``veomni-train`` with ``lora.enabled`` runs on one GPU: the base frozen in bf16 (no fp32 copy), fp32
    adapters, veomni's kernels (blocks compiled with ``compile_setting="on"``), veomni's AdamW and clipping."""

    def __init__(self, s: Settings, rank: int, alpha: float, compile_setting: str = "off") -> None:
        self.s = s
        self.state = build_parallel_state(ParallelDims.for_world(dist.get_world_size()), s.device.type)
        spec = LoraSpec(rank=rank, alpha=alpha, targets=TARGETS)
        self.model = build_model(
            s.weights, weights=s.weights, ops=_ops(s, compile_setting), dtype=torch.bfloat16, device=s.device,
            lora=spec, lora_dtype=torch.float32,
        )  # fmt: skip
        self.compile_stats = compile_stats(self.model)
        ac = s.ac in ("veomni", "all")
        if ac:
            apply_activation_checkpointing(self.model, default_fsdp_policy(self.model).block_patterns)
        self.model.train()
        self.optimizer = build_adamw(
            self.model, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=s.weight_decay
        )
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.info = {
            "ops": _ops_info(self.model),
            "precision": "base frozen in bf16; fp32 adapters (branch computed in fp32), fp32 AdamW state",
            "lora": {"rank": rank, "alpha": alpha, "targets": list(TARGETS), "trained_params": trained},
            "optimizer": "veomni.train.optim.build_adamw (torch AdamW, fused) on the adapters",
            "activation_checkpointing": ac,
        }

    def step(
        self, micro_batches: Sequence[dict[str, Any]], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), device=self.s.device)
        for batch in micro_batches:
            kwargs = {**model_inputs(batch), "shift_labels": batch["labels"], "num_items_in_batch": num_items,
                      "use_cache": False}  # fmt: skip
            with use_parallel_state(self.state):
                out = self.model(**kwargs)
            out.loss.backward()
            loss_sum += out.loss.detach().float()
        norm, _ = clip_and_step(self.optimizer, self.model, self.s.max_grad_norm, self.state)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm


class HFPeft(Contender):
    """transformers (SDPA, bf16 parameters) + PEFT's ``get_peft_model`` (fp32 adapters: PEFT's default
    ``autocast_adapter_dtype``), optionally Liger's Qwen3 kernels; torch's fused AdamW on the adapters."""

    def __init__(self, s: Settings, rank: int, alpha: float, liger: bool) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.s = s
        model = AutoModelForCausalLM.from_pretrained(
            s.weights, attn_implementation="sdpa", dtype=torch.bfloat16
        )
        model.to(s.device)
        if liger:
            import liger_kernel.transformers as liger_transformers

            patch_name, kernels = LIGER_PATCHES[model.config.model_type]
            getattr(liger_transformers, patch_name)(**kernels, cross_entropy=False, fused_linear_cross_entropy=True,
                                                    model=model)  # fmt: skip
        if s.ac == "all":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        self.model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGETS)))
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=s.weight_decay, fused=True)  # fmt: skip
        self.info = {
            "attn_implementation": model.config._attn_implementation,
            "precision": "bf16 base, PEFT's fp32 adapters, fp32 AdamW state",
            "lora": {"rank": rank, "alpha": alpha, "targets": list(TARGETS),
                     "trained_params": sum(p.numel() for p in params), "peft": importlib.metadata.version("peft")},
            "packing": "position_ids only (HF builds a packed causal mask for SDPA)",
            "activation_checkpointing": s.ac == "all",
        }  # fmt: skip
        if liger:
            self.info["liger"] = {"version": importlib.metadata.version("liger-kernel"),
                                  "patched": f"{patch_name}({', '.join(kernels)}, fused_linear_cross_entropy)"}  # fmt: skip

    def step(
        self, micro_batches: Sequence[dict[str, Any]], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), device=self.s.device)
        for batch in micro_batches:
            out = self.model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                shift_labels=batch["labels"], num_items_in_batch=num_items, use_cache=False,
            )  # fmt: skip
            out.loss.backward()
            loss_sum += out.loss.detach().float()
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm
