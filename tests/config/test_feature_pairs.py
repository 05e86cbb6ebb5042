"""Every pair of features (and the triples users run) either trains exactly or is refused before training.

Features: tp=2 +- sequence parallel; ring, Ulysses, hybrid, FPDT +- offload; MsT; recompute selective / full; Memo with
a fixed alpha and with alpha from its LP; activation checkpoints on the host, with and without layer chunks (FPDT's
block as the chunked layer's attention), every layer's input or every second one's (segments);
``memory.plan: auto``; ZeRO-1; FSDP2; gradient accumulation; a causal sliding window on two of three layers; every
switch of the Hugging Face families at once (QKV bias, q/k norms, Gemma's norms, GeGLU, scaled embedding, query
scale, per-layer RoPE base); and, in the triples, mock packed documents (``tests/dist_cases/pairs.py`` has the exact
overrides; a case with a window, documents or the families' switches is compared with the plain model that has them
too). A
case that runs trains 2 AdamW steps through the real setup and loop and must give the plain single-process model's loss
at each step within 1e-5 relative: the features only re-associate fp32 sums (~1e-7 relative per op), and the step-2 loss
also carries the step-1 update, so a wrong gradient shows there (one AdamW step at lr 1e-3 moves every weight by ~1e-3).
A refused case stops in ``resolve_layout`` (before the model is built) with one line naming both keys.
"""
from __future__ import annotations

import pytest

from tests.dist_cases import pairs as pairs
from tests.support.dist import run_dist

# refused pairs (config/combinations.py), each a set of feature names
REFUSED = [{"selective", "memo"}, {"selective", "memo-auto"}, {"selective", "fpdt"}, {"selective", "fpdt+offload"},
           {"fsdp", "zero1"}, {"ckpt-offload", "selective"}, {"ckpt-offload", "full"},
           {"chunks", "fpdt"}, {"chunks", "fpdt+offload"}]
CASES = pairs.cases()


def _refused_pair(case):
    return next((p for p in REFUSED if p <= set(case)), None)


@pytest.fixture(scope="module")
def results():
    """All cases, one spawn per world size; {case: [rank results]}."""
    out = {"reference": {base: pairs.reference_losses(base) for base in {pairs.base_of(c) for c in CASES}}}
    for world in (4, 8):
        names = [c for c in CASES if pairs.world_for(c) == world]
        ranks = run_dist(world, pairs.run_cases, names)
        for case in names:
            out[case] = [r[case] for r in ranks]
    return out


@pytest.mark.parametrize("case", CASES, ids=["+".join(c) for c in CASES])
def test_feature_combination(results, case):
    ref, got = results["reference"][pairs.base_of(case)], results[case]
    refused = _refused_pair(case)
    if refused is not None:
        msg = got[0].get("refused")
        assert msg is not None, f"{case} should be refused before training: {got[0]}"
        keys = [pairs.FEATURES[name][0] for name in sorted(refused)]
        assert "\n" not in msg and all(k in msg for k in keys), (keys, msg)
        return
    errors = [r for r in got if "losses" not in r]
    assert not errors, errors[0].get("error") or f"refused: {errors[0].get('refused')}"
    losses = got[0]["losses"]
    assert all(r["losses"] == losses for r in got), "ranks disagree on the global loss"
    assert len(losses) == len(ref) == pairs.STEPS
    for step, (a, b) in enumerate(zip(losses, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a!r} vs the plain model's {b!r}"


def test_memo_buffers_hold_tp2_ring_mst_layers():
    """The shape that crashed before the calibration measured the rounding buffers: 2 layers, hidden 128, 8/2 heads,
    512 tokens, vocab 32000, tp=2 x ring cp=2, MsT, Memo alpha=0.25. The buffer size was estimated (input + attention
    + alpha x others + 32 padded regions), came out 11% short, and the buffer grew mid-step -- copying bytes past
    its end. Now the buffers hold the exact bytes layer 0 places, and both steps give the plain model's losses."""
    model = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=8", "model.num_query_groups=2",
             "data.seq_length=512", "data.mock_data=true", "train.device=cpu", "train.train_iters=2",
             "checkpoint.save=null", "logging.log_interval=100"]
    features = ["parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=2",
                "parallel.cp_comm_type=p2p", "memory.mst=true", "memory.activation_offload=memo",
                "memory.offload_fraction=0.25"]
    ref = pairs.train_losses(0, 1, model)
    got = run_dist(4, pairs.train_losses, model + features)[0]
    for step, (a, b) in enumerate(zip(got, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a!r} vs the plain model's {b!r}"
