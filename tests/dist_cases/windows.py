"""Rank functions for tests/attention/test_windows.py: causal sliding windows (and windows with packed documents) on
every attention path and memory technique against the dense masked reference, and the step watch (no tensor with a
query and a key dimension, no read of a device value) under masks.

The reference is the plain single-process model whose attention block is ``DenseMaskedAttention``: SDPA with the
dense boolean mask of the layer's window and the batch's documents, built here and nowhere in the package."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.config.documents import DocumentRanges
from megatron_lc.data.dataset import document_fields
from megatron_lc.model.attention import SelfAttention
from megatron_lc.parallel.token_layout import shard_batch
from megatron_lc.parallel.topology import Topology
from tests.dist_cases.documents import DOCS, packed_batch
from tests.support.parity import (assert_close_grads, assert_close_loss, batch_for, build, full_grads, plain_config,
                                   sharded_loss, small_config)
from tests.support.step_watch import StepWatch


class DenseMaskedAttention(SelfAttention):
    """QKV -> SDPA with a dense ``[b, 1, s, s]`` mask: causal, the layer's window (query i sees keys (i - W, i]) and
    the documents -> out-proj. Same parameters as ``SelfAttention``."""

    def __init__(self, cfg, parts, layer_number, output_std):
        super().__init__(cfg, parts, layer_number, output_std)
        self.window = parts.layout.window(layer_number)

    def forward(self, x, rope, documents=None):
        q, k, v = self.qkv(x, rope)  # [s, b, n, d]
        s, b = q.shape[:2]
        i = torch.arange(s)
        vis = (i[:, None] >= i[None, :]).expand(b, s, s)
        if self.window is not None:
            vis = vis & (i[:, None] - i[None, :] < self.window)
        if documents is not None:
            ids = documents.ids()
            vis = vis & (ids[:, :, None] == ids[:, None, :])
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=vis[:, None], enable_gqa=True)
        return self.linear_proj(out.permute(2, 0, 1, 3).flatten(2))


def dense_reference(cfg, batch: dict, total: float):
    """The plain single-process model with ``DenseMaskedAttention``: (loss sum / total, gradients)."""
    ref_cfg = plain_config(cfg)
    model, _ = build(ref_cfg, adjust_spec=lambda spec: dataclasses.replace(spec, attention_block=DenseMaskedAttention))
    tok = model(batch["tokens"], batch["position_ids"], batch["labels"], batch.get("documents"))
    loss = (tok * batch["loss_mask"]).sum() / total
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def window_parity(rank, world, overrides, tp=1, lengths=None, seq=32):
    """The model under ``overrides`` (a window, a layout, a memory technique; documents of ``lengths`` if given)
    vs the dense masked reference: loss within 1e-5 relative, every gradient within 1e-4 (tests/support/parity.py:
    the layouts change only the order of fp32 reductions, ~1e-6 relative)."""
    cfg = small_config([f"data.seq_length={seq}", f"parallel.tensor_model_parallel_size={tp}"]
                       + (DOCS if lengths else []) + list(overrides))
    layout = resolve_layout(cfg, world)
    batch = packed_batch(seq, lengths) if lengths else batch_for(cfg)
    total = float(batch["loss_mask"].sum())
    ref_loss, ref_grads = dense_reference(cfg, batch, total)
    got, model, topo = sharded_loss(cfg, layout, batch, total)
    assert_close_loss(got, ref_loss)
    assert_close_grads(full_grads(model, topo), ref_grads)
    return got


def window_parity_cases(rank, world, cases):
    """Several (overrides, tp, lengths) cases in one spawn; a failure names its case."""
    out = []
    for overrides, tp, lengths in cases:
        try:
            out.append(window_parity(rank, world, overrides, tp, lengths))
        except AssertionError as e:
            raise AssertionError(f"case {overrides} tp={tp} documents={lengths}: {e}") from None
    return out


# every dimension of the model at or below the watch's bound (h 32, heads x d 32, SwiGLU fc1 2 x 32, padded vocab 64), the
# sequence 8x above it
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.ffn_hidden_size=32", "model.vocab_size=64", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=512", "data.mock_data=true", "train.micro_batch_size=1", "train.device=cpu"]
BOUND = 64


def tiny_batch(seq: int, lengths: list, vocab: int = 64) -> dict:
    """One sample of documents of ``lengths`` (the last cut at ``seq``) over ``vocab - 1`` ids, end-of-document
    ``vocab - 1``, with the fields ``make_batch`` gives under the three document options."""
    g = torch.Generator().manual_seed(0)
    eod = vocab - 1
    row = []
    for n in lengths:
        row += torch.randint(0, eod, (n - 1,), generator=g).tolist() + [eod]
    data = torch.tensor([row[:seq + 1]])
    tokens = data[:, :-1].contiguous()
    batch = {"tokens": tokens, "labels": data[:, 1:].contiguous(), "loss_mask": torch.ones(tokens.shape)}
    batch.update(document_fields(tokens, eod, True, True, True, batch["loss_mask"]))
    batch["documents"] = DocumentRanges.from_eod(tokens.numpy(), eod)
    return batch


def watched_step(rank, world, overrides, lengths):
    """One forward + backward of the tiny model on 512 tokens with documents of ``lengths`` and ``overrides`` under
    ``StepWatch``: (tensors with two dimensions above 64, device values read), as lists."""
    cfg = load_config(None, TINY + DOCS + list(overrides))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    model, _ = build(cfg, topo)
    local = shard_batch(tiny_batch(512, lengths), layout, topo)
    with StepWatch(BOUND) as watch:
        tok = model(local["tokens"], local["position_ids"], local["labels"], local.get("documents"))
        (tok * local["loss_mask"]).sum().backward()
    return watch.big, watch.reads
