"""Activation checkpointing executors that re-run attention (torch's ``checkpoint``), built by the model spec like
the token-wise ones of ``memo/``:

* ``SelectiveExecutor``: Megatron's ``recompute_granularity: selective`` -- core attention is checkpointed (its
  saved tensors dropped, its forward run again in backward); the token-wise parts keep their activations.
* ``LayerCheckpointExecutor``: Hugging Face's gradient checkpointing -- every layer's forward under non-reentrant
  ``torch.utils.checkpoint``: keeps the layer input and re-runs the whole layer, attention included. Not a config
  option (``recompute_granularity: full`` keeps the attention output and never recomputes attention); a spec
  choice for comparisons (bench rows, captured traces, tests)::

      model, ctx = build_model(cfg, layout, topo, adjust_spec=with_layer_checkpoint)
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint


class SelectiveExecutor:
    def __call__(self, layer, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        q, k, v = layer.pre_attention(x, rope)
        if torch.is_grad_enabled():
            o = checkpoint(layer.self_attention.core_attention, q, k, v, documents, use_reentrant=False)
        else:
            o = layer.self_attention.core_attention(q, k, v, documents)
        return layer.post_attention(x, o)


class LayerCheckpointExecutor:
    def __call__(self, layer, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return layer.plain_forward(x, rope, documents)
        return checkpoint(layer.plain_forward, x, rope, documents, use_reentrant=False)


def with_layer_checkpoint(spec):
    """``build_model``'s ``adjust_spec`` that runs every layer under ``LayerCheckpointExecutor``."""
    return dataclasses.replace(spec, executor=LayerCheckpointExecutor)
