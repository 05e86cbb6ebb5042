"""Memo offload and token-wise recompute under tensor parallelism (with and without Megatron sequence
parallelism: with SP the kept tokens of gathered tensors are rows [g*S, g*S + sA) of every tp block) and context
parallelism: loss and every gradient equal the single-process model."""
from tests import dist_cases_offload
from tests.dist import run_dist
from tests.dist_cases_offload import memo_overrides

SP = ["parallel.sequence_parallel=true"]


def test_memo_and_full_recompute_tp2():
    cases = [memo_overrides(0.25), memo_overrides(0.25) + SP, memo_overrides(0) + SP, memo_overrides(1) + SP,
             ["memory.recompute_granularity=full"] + SP]
    out = run_dist(2, dist_cases_offload.memo_parity_cases, cases, 2)
    for rank_out in out:
        # alpha 0.25 of S = 32 local tokens (16 per rank with SP): 8 (4) tokens kept, the rest recomputed
        assert [(s["tokens"], s["tokens_kept"]) for s in rank_out[0]["stats"]] == [(32, 8)] * 4
        assert [(s["tokens"], s["tokens_kept"]) for s in rank_out[1]["stats"]] == [(16, 4)] * 4
        assert [s["tokens_kept"] for s in rank_out[3]["stats"]] == [16] * 4
        assert rank_out[4]["attn_calls"] == 2  # full recompute: one attention forward per layer
