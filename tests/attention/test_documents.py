"""Packed documents (``data.reset_position_ids / reset_attention_mask / eod_mask_loss``): on every attention path
and memory technique the packed batch gives the loss and gradients of the plain model run on each document alone
(tolerances: tests/support/parity.py), with documents that straddle chunk and rank boundaries, a one-token document, a
sample that is one document on every rank, and an all-padding micro-batch (the ring and the hybrid on both layouts,
``parallel.cp_layout`` balanced -- the default -- and zigzag); the masks change the loss; and five
training steps with masks under ring cp=2 give the cp=1 losses."""
import pytest
import torch

from megatron_lc.attention.masks import attended_pairs
from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.config.documents import DocumentRanges
from megatron_lc.config.combinations import check_combinations
from megatron_lc.data.dataset import document_fields
from megatron_lc.estimate.flops import model_flops_per_sample
from megatron_lc.estimate.dims import Dims
from megatron_lc.training.metrics import flops_per_sample
from tests.dist_cases import documents as dd
from tests.support.dist import run_dist
from tests.support.parity import LOSS_RTOL, small_config

SEQ = 32
# sample 0: documents 5, 1 (EOD alone), 12, 9 and a cut one -- boundaries inside zigzag chunks and FPDT chunks;
# sample 1: one document longer than the sample (every rank holds a single document, no EOD)
LENGTHS = [[5, 1, 12, 9, 20], [40]]
# one sample of four 8-token documents: whole ring / FPDT blocks see no shared document and are skipped
ALIGNED = [[8, 8, 8, 8]]
FPDT = ["parallel.cp_comm_type=fpdt", "parallel.context_parallel_size=2", "memory.fpdt_chunk_size=8"]
MEMO = ["memory.activation_offload=memo", "memory.offload_fraction=0.25"]

# world -> cases (overrides, tp); one spawn per world, each rank loops over its cases
CASES = {
    1: [([], 1), (["memory.recompute_granularity=full"], 1), (["memory.recompute_granularity=selective"], 1),
        (MEMO, 1), (["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=4"], 1),
        (["memory.activation_offload=checkpoints", "memory.layer_chunk_size=8"], 1)],
    2: [(["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"], 1),
        (["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "parallel.cp_layout=zigzag"], 1),
        (["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "memory.recompute_granularity=full"], 1),
        (["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"] + MEMO, 1),
        (["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "memory.activation_offload=checkpoints"], 1),
        (["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"], 1),
        (FPDT + ["memory.fpdt_offload=false"], 1),
        (FPDT + ["memory.fpdt_offload=true", "memory.recompute_granularity=full"], 1),
        (["parallel.sequence_parallel=true"], 2)],
    4: [(["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p"], 1),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p", "parallel.cp_layout=zigzag"], 1),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a", "model.num_query_groups=2"], 1),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2"], 1),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2",
          "parallel.cp_layout=zigzag"], 1),
        (FPDT + ["memory.fpdt_chunk_size=4", "memory.fpdt_offload=true"] + MEMO, 2)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_packed_documents_match_each_document_alone(world):
    cases = [(over, tp, LENGTHS, SEQ) for over, tp in CASES[world]]
    if world == 4:
        cases += [(over, tp, ALIGNED, SEQ) for over, tp in CASES[world]]
    run_dist(world, dd.document_parity_cases, cases)


def test_masks_change_the_loss_and_padding_counts_nothing():
    """Without the options the same tokens give another loss (the check above would catch a mask that is never
    applied); an all-padding micro-batch gives loss 0 and zero, finite gradients under ring cp=2."""
    got, ref = run_dist(1, dd.document_parity, [], LENGTHS, SEQ, 1, False, False)[0]
    assert abs(got - ref) > 20 * LOSS_RTOL * abs(ref), (got, ref)  # measured: 3.7e-4 relative
    run_dist(2, dd.document_parity, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"], LENGTHS,
             SEQ, 1, True)


def test_demo_training_with_document_masks_ring_cp2_equals_cp1(tmp_path):
    """5 steps of the demo config on a packed corpus of 1-120-token documents: ring cp=2 gives the cp=1 losses, and
    the step counts fewer attended pairs than a causal sequence (the MFU's attention FLOPs follow the masks)."""
    prefix = str(tmp_path / "docs")
    dd.write_corpus(prefix)
    (losses, pairs), _ = run_dist(2, dd.train_losses, prefix, ["parallel.context_parallel_size=2",
                                                              "parallel.cp_comm_type=p2p"])
    ref, ref_pairs = run_dist(1, dd.train_losses, prefix, [])[0]
    for a, b in zip(losses, ref):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (losses, ref)  # the parity contract, step by step
    assert pairs == ref_pairs and 0 < pairs < 64 * 64 / 2, pairs  # measured 1690 of 2048: 1-2 documents a sample


def test_document_masks_refused_with_kernels_that_take_no_mask():
    cfg = load_config(None, ["data.mock_data=true", "data.reset_attention_mask=true",
                             "parallel.attention_backend=flash"])
    with pytest.raises(ConfigError, match="reset_attention_mask.*attention_backend=flash"):
        check_combinations(cfg)


def test_document_fields_follow_megatron():
    """The docstring's example: tokens ``a b EOD c d EOD e``."""
    tokens = torch.tensor([[1, 2, dd.EOD, 3, 4, dd.EOD, 5]])
    f = document_fields(tokens, dd.EOD, True, True, True, torch.ones(1, 7))
    assert f["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2]]
    assert f["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert f["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 1]]


def test_attention_flops_follow_the_masks():
    """Metrics: one document a sample counts as the causal formula; documents of s/4 tokens count a quarter of its
    attention. Estimator: ``data.mean_document_length`` does the same to its model FLOPs."""
    s = 64
    one = DocumentRanges.from_ids(torch.zeros(2, s, dtype=torch.long))
    quarters = DocumentRanges.from_ids(torch.arange(s).div(s // 4, rounding_mode="floor").expand(2, s))
    assert attended_pairs(one, [None], s) == 2 * s * s / 2 and attended_pairs(quarters, [None], s) == 2 * s * s / 8
    cfg = small_config([f"data.seq_length={s}"])
    linear = flops_per_sample(cfg, 0.0)
    assert flops_per_sample(cfg, s * s / 2) == flops_per_sample(cfg)
    assert flops_per_sample(cfg, s * s / 8) - linear == pytest.approx((flops_per_sample(cfg) - linear) / 4)

    def model_flops(over):
        c = small_config([f"data.seq_length={s}"] + over)
        return model_flops_per_sample(Dims.from_config(c, resolve_layout(c, 1), "cpu"))
    full = model_flops([])
    assert model_flops(["data.reset_attention_mask=true"]) == full  # no mean length given: no saving counted
    assert model_flops(["data.reset_attention_mask=true", f"data.mean_document_length={s}"]) == full
    quarter = model_flops(["data.reset_attention_mask=true", f"data.mean_document_length={s // 4}"])
    assert full - quarter == pytest.approx((flops_per_sample(cfg) - linear) * 3 / 4)
