"""transformers' output capture (``output_router_logits``, ``output_attentions``) inside compiled decoder blocks.

transformers records router logits and attention weights with forward hooks on sub-modules (the router, the
attention), which read the active collector from a ``ContextVar``. Inside a block that ``torch.compile`` traces
(`veomni.core.compile.compile_blocks`), those hooks run in the traced code, and dynamo of torch <= 2.11 cannot
trace ``ContextVar.get`` (``fullgraph=True`` then fails). transformers' collector has its own escape for
compiled code: with its ``compiling`` flag set, ``get`` returns a plain attribute. `capture_into_compiled_block`
uses it around each compiled call:

- each call gets fresh, empty lists under the collector's keys, so dynamo's guards see the same structure for
  every block and every step (no recompile), and the call's records are appended to the real collector after
  it, in order;
- the eager priming call of `compile_blocks` records into a throw-away collector: its no-grad router logits would
  otherwise count twice in the first step's load-balancing loss.

Hooks of the block module itself (``hidden_states`` is recorded on the decoder layer) run outside the compiled
``forward`` and read the ``ContextVar`` directly, as without compilation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers.utils import output_capturing

__all__ = ["attention_weights_requested", "capture_into_compiled_block"]


def attention_weights_requested() -> bool:
    """Whether the running forward was asked to return attention weights (``output_attentions=True`` as a call
    argument; the config attribute itself already refuses non-eager attention). False inside traced code, where
    the eager priming call of the same block has already answered."""
    import torch

    if torch.compiler.is_compiling():
        return False
    collected = output_capturing._active_collector.get()
    return bool(collected) and any(key in collected for key in ("attentions", "cross_attentions"))


@contextlib.contextmanager
def capture_into_compiled_block(priming: bool) -> Iterator[None]:
    """Around one call of a compiled block (see the module doc); ``priming``: the throw-away eager first call."""
    collector = output_capturing._active_collector
    if collector.compiling:
        # A whole model under torch.compile: transformers' own compile path already holds the collector.
        yield
        return
    outer = collector.context_var.get()
    if not outer:
        # No capture active (a recomputation under activation checkpointing runs after the model's forward reset
        # the collector): the hooks still read it, through the traceable path, and find nothing to record.
        collector.global_var, collector.compiling = None, True
        try:
            yield
        finally:
            collector.global_var, collector.compiling = None, False
        return
    # hidden_states' hook records the layer input first when its list is empty: a placeholder keeps that to the
    # first layer. The layer-index selection is read-only and passed as it is.
    local = {
        key: ([None] if key == "hidden_states" and value else [])
        if isinstance(value, list) and key != "_hidden_states_layers"
        else value
        for key, value in outer.items()
    }
    collector.global_var, collector.compiling = local, True
    try:
        yield
    finally:
        collector.global_var, collector.compiling = None, False
    if priming:
        return
    for key, value in local.items():
        if key == "_hidden_states_layers" or not isinstance(value, list):
            continue
        outer[key].extend(value[1:] if key == "hidden_states" and outer[key] else value)
