"""Training on packed conversations with the loss on the answers only, exact under every layout: the first step's
loss, every gradient and the validation loss of tp2 + SP, ring / Ulysses / FPDT cp2, FSDP2, MsT and Memo equal one
process on the same samples -- also when a cp rank holds only prompt tokens (it contributes zero, never NaN) --; a
batch of packed conversations equals the plain model run on each conversation alone; a global batch without any
trained token is skipped and counted.

Tolerances (fp32 on CPU; tests/support/parity.py): the layouts change only the order of the reductions (sums split
over ranks, softmax merged by lse, FSDP's reduce-scatter), each ~1e-7 relative, a few layers deep: well inside the
contract, loss 1e-5 relative and gradients 1e-4 absolute, asserted here."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from megatron_lc.config import load_config
from megatron_lc.data import build_dataset, make_batch, split_sizes
from megatron_lc.data.chat import write_conversations
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases import chat
from tests.dist_cases.documents import per_document_reference
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads, assert_close_loss, build

# name -> (corpus, overrides, validate); world 2, global batch 4 everywhere
MIXED = {
    "tp2+sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "train.micro_batch_size=4"],
    "ring-cp2": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "train.micro_batch_size=4"],
    "ulysses-cp2": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a", "train.micro_batch_size=4"],
    "fpdt-cp2": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=32",
                 "memory.fpdt_offload=true", "train.micro_batch_size=4"],
    "fsdp2-dp2": ["parallel.use_torch_fsdp2=true", "train.micro_batch_size=2"],
    "mst-dp2-accum": ["memory.mst=true", "memory.mst_mlp_chunk_size=16", "memory.mst_head_chunks=4",
                      "train.micro_batch_size=1"],
    "memo-dp2": ["memory.activation_offload=memo", "memory.offload_fraction=0.25", "train.micro_batch_size=2"],
}
PROMPT_ONLY_RANK = {f"{n}-prompt-only-rank": MIXED[n] for n in ("ring-cp2", "ulysses-cp2", "fpdt-cp2")}
SPEC = {**{n: ("mixed", ov, True) for n, ov in MIXED.items()},
        **{n: ("prompt_tail", ov, False) for n, ov in PROMPT_ONLY_RANK.items()}}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    data = {"mixed": str(d / "mixed"), "prompt_tail": str(d / "prompt_tail")}
    chat.mixed_corpus(data["mixed"])
    chat.prompt_tail_corpus(data["prompt_tail"])
    return data, str(d / "cache")


@pytest.fixture(scope="module")
def results(corpora):
    data, cache = corpora
    out = {"reference-mixed": chat.first_step(0, 1, data["mixed"], cache, ["train.micro_batch_size=4"]),
           "reference-prompt_tail": chat.first_step(0, 1, data["prompt_tail"], cache, ["train.micro_batch_size=4"],
                                                    validate=False)}
    ranks = run_dist(2, chat.cases, data, cache, SPEC)
    for name in SPEC:
        out[name] = [r[name] for r in ranks]
    return out


@pytest.mark.parametrize("case", list(SPEC))
def test_answer_only_loss_and_gradients_equal_one_process(results, case):
    corpus, _, validate = SPEC[case]
    ref, ranks = results[f"reference-{corpus}"], results[case]
    assert 0 < ref["tokens"] < 4 * chat.SEQ  # the answers only: some tokens are trained, not all
    assert all(r["finite"] and math.isfinite(r["loss"]) for r in ranks)
    assert_close_loss(ranks[0]["loss"], ref["loss"])
    assert_close_grads(ranks[0]["grads"], ref["grads"])
    if validate:
        assert_close_loss(ranks[0]["valid"], ref["valid"])
    if corpus == "prompt_tail":  # the case is what it says: cp rank 1 held no trained token
        assert {r["cp_rank"]: r["local_tokens"] for r in ranks}[1] == 0.0
        assert {r["cp_rank"]: r["local_tokens"] for r in ranks}[0] == ref["tokens"] > 0


def test_packed_conversations_equal_each_conversation_alone(corpora):
    """The one-process batch (positions restarting, attention stopping at each conversation's end, the loss on the
    answers only) against the plain model run on every conversation of the batch separately."""
    data, cache = corpora
    cfg = load_config(None, chat.MODEL + [f"data.data_path={data['mixed']}", f"data.data_cache_path={cache}",
                                          "train.micro_batch_size=4"])
    batch = make_batch(build_dataset(cfg, split_sizes(cfg, 4)).train, [0, 1, 2, 3], cfg.data)
    assert batch["documents"].rows == 4 and max(len(c) for c in batch["documents"].cu) > 3  # several per row
    total = float(batch["loss_mask"].sum())
    ref_loss, ref_grads = per_document_reference(cfg, batch, total)
    model, _ = build(cfg)
    tok = model(batch["tokens"], batch["position_ids"], batch["labels"], batch["documents"])
    loss = (tok * batch["loss_mask"]).sum() / total
    loss.backward()
    assert_close_loss(float(loss.detach()), ref_loss)
    assert_close_grads({n: p.grad for n, p in model.named_parameters()}, ref_grads)


def test_a_global_batch_without_trained_token_is_skipped_and_counted(tmp_path, caplog):
    """Conversations whose loss masks are all zero: every step is skipped (no update, the weights bit-identical),
    counted like a non-finite step, and said with its reason; the gradients are zero, never NaN."""
    write_conversations(str(tmp_path / "prompts"), [(list(range(10, 10 + n)), [0] * n) for n in range(20, 60)])
    cfg = load_config(None, chat.MODEL + [f"data.data_path={tmp_path / 'prompts'}",
                                          f"data.data_cache_path={tmp_path / 'cache'}", "train.micro_batch_size=2",
                                          "train.train_iters=2", "train.max_consecutive_skipped_steps=5",
                                          f"logging.metrics_file={tmp_path / 'm.jsonl'}"])
    t = Trainer(cfg, Topology())
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    caplog.set_level(logging.WARNING, logger="megatron_lc")
    state = t.train()
    assert state.skipped_steps == 2 and all(math.isnan(x) for x in state.losses)
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert all(p.grad is None or not p.grad.any() for p in t.model.parameters())
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 2 and "no token of the global batch is trained" in said[0], said


def test_validation_reports_the_masked_loss_of_training(corpora):
    """The valid split's loss is the training loss's definition on its samples: the plain model's token losses summed
    over the trained tokens (the answers) and divided by their count, computed here directly."""
    data, cache = corpora
    cfg = load_config(None, chat.MODEL + [f"data.data_path={data['mixed']}", f"data.data_cache_path={cache}",
                                          "train.micro_batch_size=4", "train.eval_interval=1", "train.eval_iters=2"])
    t = Trainer(cfg, Topology())
    record = t.validator.evaluate("valid", 0)
    batch = make_batch(t.setup.splits.valid, list(range(8)), cfg.data)
    trained = batch["loss_mask"].sum()
    assert 0 < trained < batch["labels"].numel() and record["tokens"] == int(trained)  # the answers only
    with torch.no_grad():
        tok = t.model(batch["tokens"], batch["position_ids"], batch["labels"], batch["documents"])
    assert_close_loss(record["loss"], float((tok * batch["loss_mask"]).sum() / trained))
