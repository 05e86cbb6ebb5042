"""Memo token-wise recompute + swap: exact against the plain model for every alpha, and counters that prove the
token split (bytes offloaded per layer, tokens recomputed), the host round trip, and the clear errors."""
import pytest
import torch

from megatron_lc.config import ConfigError
from megatron_lc.memory.memo.alpha import HostMemoryError
from tests.dist_cases.offload import GPT, memo_overrides, memo_parity, one_thread  # noqa: F401 (fixture)
from tests.support.parity import batch_for, build, reference_loss_and_grads, small_config

pytestmark = pytest.mark.usefixtures("one_thread")
ALPHAS = [0, 0.125, 0.25, 0.5, 1]
S = 32  # tokens of small_config (batch 2): alpha * S = 0, 4, 8, 16, 32 kept tokens


@pytest.mark.parametrize("alpha", ALPHAS)
def test_memo_matches_reference(alpha):
    """4 layers: layers 0, 1 swapped through host, 2, 3 (the last two) stay in their rounding buffers."""
    out = memo_parity(0, 1, memo_overrides(alpha), iters=2)
    stats = out["stats"]
    assert out["alpha"] == alpha
    assert out["attn_calls"] == 2 * 4  # attention ran once per layer and step: never recomputed
    others = stats[0]["bytes_other_kept"] + stats[0]["bytes_other_recomputed"]
    for s in stats:
        kept, dropped = int(alpha * S), S - int(alpha * S)
        assert (s["tokens"], s["tokens_kept"], s["tokens_recomputed"]) == (S, kept, dropped)
        # the "other" skeletal tensors split exactly by tokens: kept bytes = alpha * others
        assert s["bytes_other_kept"] + s["bytes_other_recomputed"] == others
        assert s["bytes_other_kept"] * S == alpha * others * S
        if alpha == 0:
            assert s["bytes_other_kept"] == 0
        if alpha == 1:
            assert s["bytes_other_recomputed"] == 0
        moved = s["bytes_input"] + s["bytes_attn"] + s["bytes_lse"] + s["bytes_other_kept"]
        assert s["bytes_to_host"] == (moved if s["swapped"] else 0)
        assert s["bytes_from_host"] == s["bytes_to_host"]
    assert [s["swapped"] for s in stats] == [True, True, False, False]
    # input: S*b*h fp32; attention output: S*b*nq*d fp32; lse: b*nq*S fp32
    assert (stats[0]["bytes_input"], stats[0]["bytes_attn"], stats[0]["bytes_lse"]) == (S * 2 * 64 * 4,) * 2 + (
        2 * 8 * S * 4,)


@pytest.mark.parametrize("alpha", [0, 0.25, 1])
def test_memo_gpt_matches_reference(alpha):
    memo_parity(0, 1, memo_overrides(alpha, layers=3) + GPT)


def test_memo_auto_alpha_matches_reference():
    out = memo_parity(0, 1, memo_overrides("auto"))
    assert 0.0 <= out["alpha"] <= 1.0


def _model(overrides):
    cfg = small_config(overrides)
    return (cfg, *build(cfg))


def _loss(model, batch):
    tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
    return (tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def test_swapped_layers_really_come_back_from_host():
    """Wipe the host copies of the swapped layers between forward and backward: the gradients change, so the
    backward really reads what went through host (the rounding buffers hold other layers by then)."""
    cfg, model, ctx = _model(memo_overrides(0.5, layers=6))
    batch = batch_for(cfg)
    _, ref_grads = reference_loss_and_grads(cfg, batch)
    rt = ctx.memo
    loss = _loss(model, batch)
    assert sorted(rt.host) == [0, 1, 2, 3]  # layers 4, 5 (the last two) never leave the device
    assert rt.buffers[0].owner.layer == 4 and rt.buffers[1].owner.layer == 5
    for layer in range(4):
        rt.host[layer].zero_()
    loss.backward()
    err = max((p.grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
    assert err > 1e-3, "gradients did not depend on the host copies"


def test_second_forward_before_backward_is_refused():
    cfg, model, ctx = _model(memo_overrides(0.5))
    batch = batch_for(cfg)
    first = _loss(model, batch)
    _loss(model, batch)
    with pytest.raises(RuntimeError, match="one forward then its backward"):
        first.backward()


def test_eval_forward_is_plain():
    cfg, model, ctx = _model(memo_overrides(0.5))
    batch = batch_for(cfg)
    with torch.no_grad():
        got = _loss(model, batch)
    ref, _ = reference_loss_and_grads(cfg, batch)
    assert abs(float(got) - ref) <= 1e-5 * abs(ref)


def test_out_of_host_memory_is_a_clear_error_before_training():
    # 4 layers -> 2 swapped; input + attention output + lse = 34816 bytes per layer: 69632 bytes needed at alpha 0
    with pytest.raises(HostMemoryError, match=r"out of host memory even with offload_fraction 0.*2 swapped layers"):
        _model(memo_overrides(0) + ["memory.host_memory_gb=0.00006"])  # 64425 bytes
    with pytest.raises(HostMemoryError, match=r"offload_fraction \(1.0\) needs .* largest fraction that fits is"):
        _model(memo_overrides(1.0) + ["memory.host_memory_gb=0.0001"])  # 107374 bytes: alpha <= 0.07
    with pytest.raises(HostMemoryError, match="out of host memory"):
        _model(memo_overrides("auto") + ["memory.host_memory_gb=0.00006"])


def test_selective_with_memo_is_refused():
    with pytest.raises(ConfigError, match="selective"):
        _model(memo_overrides(0.5) + ["memory.recompute_granularity=selective"])


def test_rounding_buffers_allocated_before_training_and_accounted():
    cfg, model, ctx = _model(memo_overrides(0.5))
    rt = ctx.memo
    cap = rt.buffers[0].capacity
    assert rt.buffers[1].capacity == cap and rt.account.live["memo.rounding"] == 2 * cap
    _loss(model, batch_for(cfg)).backward()
    assert rt.buffers[0].capacity == cap  # the profiled size was enough: no growth during training
    assert rt.account.live["memo.recompute"] == 0
    assert rt.account.peak_by_tag["memo.recompute"] > 0


def test_bf16_autocast_recompute_keeps_dtypes_and_weight_casts_are_not_offloaded():
    """Under autocast (bf16 on GPU in training; CPU autocast here) the recompute re-enters autocast, and the bf16
    weight copies autograd saves are kept by reference (per step, not per token): the kept/recomputed bytes still
    split exactly by tokens. Gradients: the two token halves' weight gradients are each rounded to bf16 before
    they are summed, so they differ from one bf16 GEMM by ~1 bf16 ulp (2^-8 relative): tolerance 2e-2 of the
    largest entry; the loss does not depend on the split."""
    def run(overrides):
        cfg, model, ctx = _model(["model.num_layers=3"] + overrides)
        batch = batch_for(cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
        loss = (tok.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        return float(loss), {n: p.grad for n, p in model.named_parameters()}, ctx.memo

    ref_loss, ref_grads, _ = run([])
    loss, grads, rt = run(memo_overrides(0.25, layers=3))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for k, g in grads.items():
        assert (g - ref_grads[k]).abs().max() <= 2e-2 * ref_grads[k].abs().max() + 1e-6, k
    s = rt.stats()[0]
    assert s["bytes_other_kept"] * 3 == s["bytes_other_recomputed"]  # 8 kept, 24 recomputed tokens
    assert rt.buffers[0].capacity == rt.buffers[1].capacity  # no growth: casts not offloaded


@pytest.mark.parametrize("overrides", [memo_overrides(0.25), ["memory.recompute_granularity=full"]])
def test_composes_with_mst(overrides):
    """MsT's chunked MLP runs inside the token-wise post-attention part: kept tokens through its own autograd
    Function (its saved inputs go to the slot), dropped tokens recomputed through it."""
    mst = ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=3"]
    out = memo_parity(0, 1, overrides + mst)
    assert out["stats"][0]["tokens_recomputed"] > 0
