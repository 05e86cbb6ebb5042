"""recompute_granularity: full (token-wise, attention never recomputed) and selective (Megatron's: core attention
checkpointed), both exact against the plain model; the token split helper."""
import pytest
import torch

from megatron_lc.memory.token_split import TokenSplit
from tests.dist_cases.offload import GPT, memo_parity, one_thread  # noqa: F401 (fixture)
from tests.support.parity import batch_for, build, small_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_full_recompute_matches_reference_without_recomputing_attention(arch):
    out = memo_parity(0, 1, ["model.num_layers=3", "memory.recompute_granularity=full"] + (GPT if arch == "gpt" else []),
                      iters=2)
    assert out["alpha"] == 0.0
    assert out["attn_calls"] == 2 * 3  # one attention forward per layer and step
    for s in out["stats"]:
        assert not s["swapped"] and s["bytes_to_host"] == 0
        assert s["tokens_recomputed"] == s["tokens"] == 32 and s["bytes_other_kept"] == 0
        assert s["bytes_other_recomputed"] > 0


def test_selective_recompute_matches_reference_and_reruns_core_attention():
    cfg = small_config(["memory.recompute_granularity=selective"])
    model, _ = build(cfg)
    calls = []
    for layer in model.layers:
        layer.self_attention.core_attention.register_forward_pre_hook(lambda *a: calls.append(1))
    memo = memo_parity(0, 1, ["memory.recompute_granularity=selective"])
    assert memo is None  # no Memo runtime: selective is plain autograd with attention checkpointed
    batch = batch_for(cfg)
    tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
    assert len(calls) == 2
    tok.sum().backward()
    assert len(calls) == 4  # each layer's core attention ran again in backward


@pytest.mark.parametrize("G,S,sA", [(1, 4, 1), (2, 4, 1), (2, 4, 0), (2, 4, 4), (3, 5, 2)])
def test_token_split_gathered_round_trip(G, S, sA):
    sp = TokenSplit(S, sA, G)
    t = torch.arange(G * S * 2).view(G * S, 2)
    a, d = sp.gathered(t)
    assert a.shape[0] == G * sA and d.shape[0] == G * (S - sA)
    # kept rows are rows [g*S, g*S + sA) of every block g
    assert a[:, 0].tolist() == [2 * (g * S + i) for g in range(G) for i in range(sA)]
    assert torch.equal(sp.merge(a, d), t)


def test_rope_tables_of_the_split_are_computed_once_for_all_layers():
    """With sequence parallelism (G > 1) the kept / dropped RoPE rows are copies; the layers' executors (one per
    layer) share one copy through their runtime, so L layers do not hold L copies of cos and sin until the next
    forward (0.25 GiB a layer for Llama3-8B at 1M tokens, tp2 cp4)."""
    from megatron_lc.memory.memo.executor import MemoExecutor
    from megatron_lc.memory.memo.runtime import MemoRuntime

    rt = MemoRuntime(num_layers=3, offload=False)
    layers = [MemoExecutor(rt, sp_groups=2) for _ in range(3)]
    rope = (torch.randn(2 * 8, 1, 1, 4), torch.randn(2 * 8, 1, 1, 4))  # [G*S, b, 1, d]
    split = TokenSplit(8, 3, 2)
    parts = [ex.rope_parts(rope, split) for ex in layers]
    for a, d, _ in parts[1:]:
        assert all(x is y for x, y in zip(a + d, parts[0][0] + parts[0][1]))
    assert torch.equal(parts[0][1][0], split.gathered(rope[0])[1])
    fresh = (rope[0].clone(), rope[1].clone())  # the next forward's tables replace them
    assert layers[2].rope_parts(fresh, split)[1][0] is not parts[0][1][0]


def test_a_reruns_output_is_freed_before_its_backward_when_its_last_op_is_a_sum():
    """``backward_from``: the residual add's output is only the graph's root (its bytes go before the backward);
    after an op whose backward reads its output (exp) the output stays. Gradients are those of plain backward."""
    from megatron_lc.memory.forward_state import backward_from

    x = torch.randn(6, 4, requires_grad=True)
    dy = torch.randn(6, 4)
    seen = []
    x.register_hook(lambda g: seen.append(y.untyped_storage().nbytes()) or g)
    y = x * 3 + x.exp()  # ends with an add, like the layer's residual
    backward_from(y, dy)
    assert seen == [0]  # freed before autograd reached the input
    assert torch.allclose(x.grad, dy * (3 + x.detach().exp()))
    x.grad = None
    seen.clear()
    y = (x * 3).exp()
    backward_from(y, dy)
    assert seen == [6 * 4 * 4] and torch.allclose(x.grad, dy * 3 * y.detach())


def test_the_attention_blocks_output_is_gone_before_the_mlp_runs():
    """``TransformerLayer.residual``: once ``r = x + block_out`` exists nothing needs ``block_out`` (the sum saves
    nothing), so it is not held through the MLP's forward (the rehearsal saw it there: 1 GiB at Llama3-8B x 1M,
    cp 8, bf16)."""
    import weakref

    model, _ = build(small_config())
    layer = model.layers[0]
    x = torch.randn(8, 2, layer.pre_mlp_layernorm.weight.numel(), requires_grad=True)
    refs, alive = [], []
    layer.mlp.register_forward_pre_hook(lambda mod, args: alive.append(refs[0]() is not None))

    def block_out():
        t = torch.randn_like(x)
        refs.append(weakref.ref(t))
        return t

    layer.residual(x, block_out())  # passed as a temporary, as post_attention and plain_forward pass it
    assert alive == [False]
