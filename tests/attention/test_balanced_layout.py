"""The balanced ring layout (``parallel.cp_layout: balanced``, the default with a ring): the solver's partition and
balance, the exchange plan against a brute-force count of the keys each rank's queries see, exactness of ring cp 2 /
4 and the hybrid with documents of many shapes, alone and with a window, Memo, MsT, host checkpoints and tp + SP,
against the plain model run on each document alone (tolerances: tests/support/parity.py -- the layout changes only
which rank sums which fp32 softmax terms, merged by lse), and the bytes it moves against the plan. FSDP2, ZeRO-1 and
the zigzag with documents under training: tests/config/test_feature_pairs.py's triples."""
import numpy as np
import pytest

from megatron_lc.attention.kv_plan import kv_plan
from megatron_lc.config import ConfigError, load_config
from megatron_lc.config.documents import DocumentRanges
from megatron_lc.data.dataset import mock_document_ends
from megatron_lc.parallel.cp_balance import balanced_spans, rank_work, zigzag_spans
from tests.dist_cases import balanced as db
from tests.dist_cases import documents as dd
from tests.dist_cases import windows as dw
from tests.support.dist import run_dist


def _docs(s, lengths_per_row):
    rows = []
    for lengths in lengths_per_row:
        ends = np.cumsum(lengths)
        rows.append((0, *(int(e) for e in ends if e < s), s))
    return DocumentRanges(tuple(rows))


def _tokens(spans):
    return [t for a, b in spans for t in range(a, b)]


def test_the_docstring_example():
    docs = _docs(16, [[10, 3, 3]])
    spans = balanced_spans(docs, 16, 2, None)
    assert spans == (((0, 3), (8, 10), (13, 16)), ((3, 8), (10, 13)))
    assert rank_work(docs, 16, spans, None) == [31, 36] and rank_work(docs, 16, zigzag_spans(16, 2), None) == [19, 48]
    plan = kv_plan(docs, None, spans, 16)
    assert plan.rows == [[(), ((0, 5),)], [((0, 3),), ()]] and plan.received[0][1] == ((3, 8, 0),)


@pytest.mark.parametrize("s,R", [(16, 2), (64, 4), (96, 8)])
def test_one_causal_document_is_the_zigzag(s, R):
    assert balanced_spans(None, s, R, None) == zigzag_spans(s, R)
    joined = [tuple(_tokens(sp)) for sp in balanced_spans(_docs(s, [[s]]), s, R, None)]
    assert joined == [tuple(_tokens(sp)) for sp in zigzag_spans(s, R)]


CASES = [(48, 3, [[5, 1, 12, 9, 20]], None), (48, 4, [[30, 2, 9], [7, 7, 7, 7, 7, 13]], None),
         (48, 4, [[5, 1, 12, 9, 20]], 5), (40, 2, [[40]], 7), (60, 6, [[1] * 60], None)]


@pytest.mark.parametrize("s,R,lengths,window", CASES)
def test_the_layout_is_a_partition_and_the_plan_sends_exactly_the_keys_seen(s, R, lengths, window):
    """Every token on one rank, s/R each; rank r receives from j exactly the keys of j that some query of r sees
    (brute force over every (query, key) pair of every row), at the rows j holds them."""
    docs = _docs(s, lengths)
    spans = balanced_spans(docs, s, R, window)
    owned = [_tokens(sp) for sp in spans]
    assert sorted(sum(owned, [])) == list(range(s)) and {len(o) for o in owned} == {s // R}
    ids = docs.ids().numpy()
    plan = kv_plan(docs, window, spans, s)
    for r in range(R):
        seen = {k for q in owned[r] for k in range(s) for row in ids
                if row[k] == row[q] and k <= q and (window is None or q - k < window)}
        for j in range(R):
            want = sorted(seen & set(owned[j])) if j != r else []
            got = [t for a, b, _ in plan.received[r][j] for t in range(a, b)]
            assert got == want, (r, j)
            assert [owned[j][i] for a, b in plan.rows[r][j] for i in range(a, b)] == want  # j's local rows


@pytest.mark.parametrize("mean", [256, 2048])
def test_mock_documents_are_balanced_within_one_percent(mean):
    """Mock packed documents (the data path's), 32K tokens on 8 ranks, 8 seeds: slowest / mean pairs <= 1.01
    (bench/document_balance.py prints the full-scale cases); the zigzag is seen far off."""
    s, R = 32768, 8
    worst = zigzag = 0.0
    for seed in range(8):
        ends = mock_document_ends(np.random.default_rng(seed), s, mean) + 1
        docs = DocumentRanges(((0, *(int(e) for e in ends if e < s), s),))
        w = np.array(rank_work(docs, s, balanced_spans(docs, s, R, None), None))
        worst = max(worst, w.max() / w.mean())
        z = np.array(rank_work(docs, s, zigzag_spans(s, R), None))
        zigzag = max(zigzag, z.max() / z.mean())
    assert worst <= 1.01 and zigzag > 1.3, (worst, zigzag)


def test_balanced_is_refused_where_there_is_no_ring():
    with pytest.raises(ConfigError, match="parallel.cp_layout=balanced with parallel.cp_comm_type=a2a") as e:
        load_config(None, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a",
                           "parallel.cp_layout=balanced"])
    assert "\n" not in str(e.value)


RING2, RING4 = (["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"],
                ["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p"])
HYBRID = ["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2"]
MEMO = ["memory.activation_offload=memo", "memory.offload_fraction=0.25"]
MST = ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=4"]
CKPT = ["memory.activation_offload=checkpoints"]
# two rows each (micro-batch 2): one document; many short; one longer than a rank's share (16 at cp 2, 8 at cp 4);
# lengths dividing nothing
SHAPES = {"one": [[40], [40]], "short": [[3, 2, 4, 1, 5, 2, 3, 4, 2, 3, 6], [2, 5, 1, 3, 3, 4, 2, 6, 1, 2, 7]],
          "long": [[20, 3, 2, 9], [2, 25, 7]], "odd": [[7, 11, 13, 5], [9, 9, 9, 9]]}
PARITY = {2: [(RING2, 1, shape) for shape in SHAPES] + [(RING2 + MEMO, 1, "long"), (RING2 + MST, 1, "short"),
                                                         (RING2 + CKPT, 1, "odd")],
          4: [(RING4, 1, shape) for shape in SHAPES] + [(HYBRID, 1, "long"),
                                                        (RING2 + ["parallel.sequence_parallel=true"], 2, "odd"),
                                                        (RING4 + MEMO, 1, "short")]}


@pytest.mark.parametrize("world", sorted(PARITY))
def test_balanced_ring_matches_each_document_alone(world):
    run_dist(world, dd.document_parity_cases, [(over, tp, SHAPES[shape], 32) for over, tp, shape in PARITY[world]])


WINDOWS = {2: [(RING2 + ["model.sliding_window=3"], 1, SHAPES["long"]), (RING2 + ["model.sliding_window=5"], 1, None)],
           4: [(RING4 + ["model.sliding_window=12", "model.layer_types=sliding_attention,full_attention"], 1,
                SHAPES["odd"]), (HYBRID + ["model.sliding_window=3"], 1, SHAPES["short"])]}


@pytest.mark.parametrize("world", sorted(WINDOWS))
def test_balanced_ring_with_windows_matches_the_dense_masked_model(world):
    run_dist(world, dw.window_parity_cases, WINDOWS[world])


def test_the_exchange_moves_what_the_plan_says_and_local_documents_move_nothing():
    """Ring cp 4: every rank receives in forward the plan's bytes (the backward receives them again, plus the fp32
    dk/dv of the rows it sent); four 8-token documents a row, each a rank's share: nothing is sent at all."""
    for got, sent, planned in run_dist(4, db.traffic, SHAPES["odd"]):
        assert planned > 0 and got["p2p_fwd"] == planned, (got, planned)
    for got, sent, planned in run_dist(4, db.traffic, [[8, 8, 8, 8], [8, 8, 8, 8]]):
        assert planned == 0 and sent == 0 and not any(got.values()), (got, sent)


def test_a_forward_re_run_in_backward_is_counted_apart():
    """Host checkpoints run each layer's forward again inside the backward: its receipts go under ``p2p_fwd.rerun``,
    so the forward's stay the plan's (the rehearsal's per-layer figures beside tools/cp_layout.py's were twice them
    with host checkpoints: Qwen3-32B at 1.5M, "100.0%" off)."""
    for got, sent, planned in run_dist(2, db.traffic, SHAPES["odd"], 32, CKPT):
        assert planned > 0 and got["p2p_fwd"] == planned and got.get("p2p_fwd.rerun") == planned, (got, planned)
