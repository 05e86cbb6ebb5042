"""Multi-rank cases of the data tests (tests/data/test_data_blend.py): what each rank reads, put back into full-sequence
global batches, under several layouts in one spawn; training resumed at another layout."""
from __future__ import annotations

import numpy as np
import torch

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.data import build_dataset, split_sizes
from megatron_lc.data.indexed import write_indexed
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.eval.by_position import gather_sequence
from megatron_lc.training.batches import microbatches

EOD = 255  # NullTokenizer of 255 ids: the end-of-document id is 255
FIELDS = ("tokens", "labels", "position_ids", "loss_mask", "document_ids")


def write_corpus(prefix: str, n_docs: int, seed: int, base: int = 0, eod: bool = False) -> None:
    """Documents of 1 to 60 ids in ``[base, base + 100)`` (so a sample's source shows in its ids); ``eod``: each
    ends with EOD in the file (as ``--append-eod`` writes), else the reader adds it."""
    g = np.random.default_rng(seed)
    docs = [list(g.integers(base, base + 100, int(g.integers(1, 61)))) + ([EOD] if eod else []) for _ in range(n_docs)]
    write_indexed(prefix, docs)


def config(data_path, cache: str, overrides=()):
    base = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
            "model.ffn_hidden_size=128", "model.make_vocab_size_divisible_by=64", "data.seq_length=32",
            "data.tokenizer_type=NullTokenizer", "data.vocab_size=255", f"data.data_cache_path={cache}",
            "data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_iters=20", "train.device=cpu",
            "logging.peak_tflops=1", f"data.data_path={data_path}"]
    return load_config(None, base + list(overrides))


def read_batches(rank, world, data_path, cache, layouts, steps):
    """For each layout (overrides), every micro-batch this rank reads in ``steps`` steps, full-sequence:
    ``[layout][step] -> {sample_id: {field: row}}``."""
    result = []
    for overrides in layouts:
        cfg = config(data_path, cache, overrides)
        layout = resolve_layout(cfg, world)
        topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
        train = build_dataset(cfg, split_sizes(cfg, layout.global_batch_size)).train
        per_step = []
        for step in range(steps):
            rows = {}
            for b in microbatches(cfg, layout, topo, train, step * layout.global_batch_size, torch.device("cpu")):
                ids = b["sample_ids"].tolist()
                full = {"sample_ids": ids}
                for k in FIELDS:
                    v = b[k]
                    full[k] = (v if k == "document_ids" else gather_sequence(v, layout, topo, cfg.data.seq_length,
                                                                                  b.get("documents")))
                for i, sid in enumerate(ids):
                    rows[sid] = {k: full[k][i].numpy() for k in FIELDS}
            per_step.append(rows)
        result.append(per_step)
    return result


def reference_batches(data_path, cache, steps, overrides=()):
    """The one-process global batches: ``[step] -> {sample_id: {field: row}}``."""
    return read_batches(0, 1, data_path, cache, [list(overrides)], steps)[0]


def record_full_batches(rank, world, data_path, cache, overrides):
    """Train (``Trainer``) and return the full-sequence rows of every sample each step read on this rank:
    ``[step] -> {sample_id: tokens}`` (a test hook on the setup's ``microbatches``)."""
    from megatron_lc.training.loop import Trainer

    cfg = config(data_path, cache, overrides)
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    trainer = Trainer(cfg, topo, layout=layout)
    seen = []
    original = trainer.microbatches

    def hooked(consumed):
        batches = original(consumed)
        rows = {}
        for b in batches:
            tokens = gather_sequence(b["tokens"], layout, topo, cfg.data.seq_length, b.get("documents"))
            rows.update({int(s): tokens[i].numpy() for i, s in enumerate(b["sample_ids"].tolist())})
        seen.append(rows)
        return batches

    trainer.microbatches = hooked
    state = trainer.train()
    return seen, state.consumed_samples



def valid_losses(rank, world, data_path, cache, layouts):
    """For each layout (overrides): the valid loss of the freshly built model (initialisation does not depend on
    the layout) and its token count, evaluated by the Validator under that layout."""
    from megatron_lc.training.loop import Trainer

    out = []
    for overrides in layouts:
        cfg = config(data_path, cache, ["train.eval_interval=1", "train.eval_iters=3"] + list(overrides))
        layout = resolve_layout(cfg, world)
        topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
        trainer = Trainer(cfg, topo, layout=layout)
        rec = trainer.validator.evaluate("valid", 0)
        out.append((rec["loss"], rec["tokens"]))
    return out
