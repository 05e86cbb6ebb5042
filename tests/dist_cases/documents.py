"""Rank functions for tests/attention/test_documents.py: packed documents that do not attend to each other.

The reference is the plain single-process model run on each document separately (positions restarting at 0, a
batch of one document), its token losses summed and divided by the global count of counted tokens -- exactly what
the masked packed run must give, forward and backward (tolerances: tests/support/parity.py)."""
from __future__ import annotations

import math

import torch

from megatron_lc.config import resolve_layout
from megatron_lc.config.documents import DocumentRanges
from megatron_lc.data.dataset import document_fields
from megatron_lc.parallel.topology import Topology
from tests.support.parity import (assert_close_grads, assert_close_loss, build, full_grads, plain_config, sharded_loss,
                                   small_config)

EOD = 255  # vocab 256: the last id ends a document
DOCS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]


def packed_batch(seq: int, lengths: list[list[int]], seed: int = 0, all_padding: bool = False) -> dict:
    """Samples made of documents of the given lengths (each ends with EOD, except a sample's cut last one)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lens in lengths:
        row = []
        for n in lens:
            row += torch.randint(0, EOD, (max(n - 1, 0),), generator=g).tolist() + [EOD]
        row = (row + torch.randint(0, EOD, (seq + 1,), generator=g).tolist())[:seq + 1]
        rows.append(row)
    data = torch.tensor(rows)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape),
             "position_ids": torch.arange(seq).expand(len(rows), seq).contiguous()}
    batch.update(document_fields(tokens, EOD, reset_position_ids=True, reset_attention_mask=True,
                                 eod_mask_loss=True, loss_mask=batch["loss_mask"]))
    batch["documents"] = DocumentRanges.from_eod(tokens.numpy(), EOD)  # what make_batch adds
    if all_padding:
        batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    return batch


def per_document_reference(cfg, batch: dict, total: float):
    """The plain model on each document alone: (loss sum / total, gradients)."""
    ref_cfg = plain_config(cfg)
    for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        setattr(ref_cfg.data, k, False)
    model, _ = build(ref_cfg)
    loss = torch.zeros(())
    docs = batch["document_ids"]
    for b in range(docs.shape[0]):
        for d in docs[b].unique():
            idx = (docs[b] == d).nonzero().flatten()
            n = idx.numel()
            tok = model(batch["tokens"][b, idx][None], torch.arange(n)[None], batch["labels"][b, idx][None])
            loss = loss + (tok[0] * batch["loss_mask"][b, idx]).sum()
    (loss / total).backward()
    return float(loss.detach() / total), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def document_parity(rank, world, overrides, lengths, seq, tp=1, all_padding=False, masks=True):
    """The packed batch with document masks under ``overrides`` vs the per-document plain model."""
    cfg = small_config([f"data.seq_length={seq}", f"parallel.tensor_model_parallel_size={tp}"]
                       + (DOCS if masks else []) + list(overrides))
    layout = resolve_layout(cfg, world)
    batch = packed_batch(seq, lengths, all_padding=all_padding)
    total = max(float(batch["loss_mask"].sum()), 1.0)
    ref_loss, ref_grads = per_document_reference(cfg, batch, total)
    if not masks:  # the same tokens as one causal sequence
        del batch["document_ids"], batch["documents"]
        batch["position_ids"] = torch.arange(seq).expand_as(batch["tokens"]).contiguous()
    got, model, topo = sharded_loss(cfg, layout, batch, total)
    assert math.isfinite(got), got
    if not masks:
        return got, ref_loss
    if all_padding:
        assert got == 0.0 and ref_loss == 0.0
        assert all(torch.isfinite(g).all() and not g.any() for g in full_grads(model, topo).values())
        return got
    assert_close_loss(got, ref_loss)
    assert_close_grads(full_grads(model, topo), ref_grads)
    return got


def document_parity_cases(rank, world, cases):
    """Several (overrides, tp) cases in one spawn; a failure names its case."""
    out = []
    for overrides, tp, lengths, seq in cases:
        try:
            out.append(document_parity(rank, world, overrides, lengths, seq, tp))
        except AssertionError as e:
            raise AssertionError(f"case {overrides} tp={tp}: {e}") from None
    return out



def write_corpus(prefix: str, n_docs: int = 200, seed: int = 0) -> None:
    """A Megatron .bin/.idx corpus of documents 1 to 120 tokens long (ids below the EOD)."""
    from megatron_lc.data.indexed import write_indexed

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 121, (n_docs,), generator=g).tolist()
    write_indexed(prefix, [torch.randint(0, EOD, (n,), generator=g).tolist() for n in lengths])


# the demo config (configs/tiny_cpu.yaml) shrunk like tests/parallel/test_cp_model.py's, on a packed corpus read through
# the
# demo's path (EOD between documents) with the NullTokenizer of 255 ids (EOD = 255)
DEMO_SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=256",
              "model.make_vocab_size_divisible_by=64", "data.seq_length=64", "data.prepare_demo_data=false",
              "data.tokenizer_type=NullTokenizer", "data.vocab_size=255", "train.micro_batch_size=2", "train.global_batch_size=4",
              "train.train_iters=5", "train.lr_warmup_iters=1", "checkpoint.save=", "logging.log_interval=5"]


def train_losses(rank, world, data_path, overrides):
    """Losses of 5 Trainer steps of the shrunk demo with document masks, and the last step's attended pairs."""
    import tempfile

    from megatron_lc.config import load_config
    from megatron_lc.training.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("configs/tiny_cpu.yaml", DEMO_SMALL + DOCS + [f"data.data_path={data_path}",
                          f"logging.metrics_file={tmp}/metrics.jsonl"] + list(overrides))
        layout = resolve_layout(cfg, world)
        topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
        trainer = Trainer(cfg, topo, layout=layout)
        return trainer.train().losses, trainer.pairs
