"""Memo offload and token-wise recompute under tensor parallelism (with and without Megatron sequence
parallelism: with SP the kept tokens of gathered tensors are rows [g*S, g*S + sA) of every tp block) and context
parallelism: loss and every gradient equal the single-process model."""
from tests.dist_cases import offload as dist_cases_offload
from tests.support.dist import run_dist
from tests.dist_cases.offload import memo_overrides

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


def test_memo_and_full_recompute_cp2():
    """cp = 2: ring (zigzag p2p) and Ulysses (a2a), kv heads 4 over 2 ranks; attention through its (out, lse) form."""
    ring, uly = ["parallel.cp_comm_type=p2p"], ["parallel.cp_comm_type=a2a"]
    cases = [memo_overrides(0.25) + ring, memo_overrides(0.5) + uly, ["memory.recompute_granularity=full"] + ring,
             memo_overrides(1) + uly, ["memory.recompute_granularity=selective"] + ring]
    out = run_dist(2, dist_cases_offload.memo_parity_cases, cases, 1, 2)
    for rank_out in out:
        assert [(s["tokens"], s["tokens_kept"]) for s in rank_out[0]["stats"]] == [(16, 4)] * 4
        assert rank_out[2]["attn_calls"] == 2


def test_memo_and_full_recompute_fpdt_cp2():
    """FPDT replaces the attention block whole (chunked QKV/attention/out-proj with its own offload): block mode,
    the token split applies to norm 1 and residual + MLP, the block's saved tensors are kept whole."""
    F = ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8"]
    cases = [memo_overrides(0.25) + F, ["memory.recompute_granularity=full"] + F,
             memo_overrides(0.5) + F + ["memory.fpdt_offload=false"]]
    out = run_dist(2, dist_cases_offload.memo_parity_cases, cases, 1, 2)
    for rank_out in out:
        s = rank_out[0]["stats"][0]
        assert (s["tokens"], s["tokens_kept"]) == (16, 4)
        assert s["bytes_other_kept"] * 3 == s["bytes_other_recomputed"]  # 4 kept, 12 recomputed tokens
        assert rank_out[1]["attn_calls"] == 2  # 2 layers, the block ran once each


def test_memo_four_ranks_tp2_cp2_and_hybrid_cp4():
    """tp=2 x cp=2 (ring, SP) and cp=4 = ulysses 2 x ring 2 (a2a+p2p) with one kv head (replicated for Ulysses)."""
    cases = [(memo_overrides(0.25) + SP + ["parallel.cp_comm_type=p2p"], 2, 2),
             (memo_overrides(0.5) + ["parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2",
                                     "model.num_query_groups=1"], 1, 4)]
    out = run_dist(4, dist_cases_offload.memo_parity_cases, cases)
    for rank_out in out:
        assert [(s["tokens"], s["tokens_kept"]) for s in rank_out[0]["stats"]] == [(8, 2)] * 4
        assert [(s["tokens"], s["tokens_kept"]) for s in rank_out[1]["stats"]] == [(8, 4)] * 4


ALPHAS = (0, 0.125, 0.25, 0.5, 1)


def test_memo_alpha_grid_tp2_and_cp2():
    """Every α of the grid under tp = 2 (no SP: 32 local tokens) and ring cp = 2 (16 local tokens); the parity
    asserts (loss 1e-5 relative, every gradient 1e-4) run inside ``memo_parity_cases``."""
    for world_args, tokens in (((2,), 32), ((1, 2), 16)):
        extra = [] if len(world_args) == 1 else ["parallel.cp_comm_type=p2p"]
        out = run_dist(2, dist_cases_offload.memo_parity_cases, [memo_overrides(a) + extra for a in ALPHAS],
                       *world_args)
        for rank_out in out:
            for a, case in zip(ALPHAS, rank_out):
                assert [(s["tokens"], s["tokens_kept"]) for s in case["stats"]] == [(tokens, int(a * tokens))] * 4
