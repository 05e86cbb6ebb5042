"""MsT (memory.mst): the mini-sequence MLP and LM head + loss give the unchunked model's loss and every gradient.

Tolerances (fp32, CPU): chunking only splits the sums behind the weight gradients (sum over tokens) into per-chunk
partial sums added in a different order, and the head's softmax normaliser is the same per-token reduction; each
reordering costs ~1e-7 relative, far inside the contract (loss 1e-5 relative, grads 1e-4 absolute,
tests/support/parity.py).
The function-level tests compare against autograd through the same ops at a tighter 1e-5, still ~100x the observed
error (~1e-7).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lc.memory.mst import MIN_HEAD_CHUNK, MiniSequenceLMHead, MiniSequenceMLP, head_chunk_tokens
from megatron_lc.memory.mst import modules as mst_mod
from megatron_lc.memory.mst.head_function import mini_sequence_cross_entropy
from megatron_lc.memory.mst.mlp_function import chunk_bounds, mini_sequence_mlp
from megatron_lc.memory.recompute import with_layer_checkpoint
from megatron_lc.parallel.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lc.parallel.topology import Topology
from tests.support.parity import (assert_close_grads, assert_close_loss, batch_for, build, reference_loss_and_grads,
                          small_config)

CPU = torch.device("cpu")
GPT = ["model.normalization=LayerNorm", "model.swiglu=false", "model.position_embedding_type=learned_absolute",
       "model.add_bias_linear=true", "model.untie_embeddings_and_output_weights=false",
       "model.max_position_embeddings=64"]


def test_chunk_bounds_cover_every_token_once():
    # the MsT reference drops the tail when N % M != 0; here the last chunk takes it
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 3)]
    for n, c in [(4100, 1024), (97, 7), (1, 1)]:
        b = chunk_bounds(n, c)
        assert b[0][0] == 0 and b[-1][1] == n and all(x[1] == y[0] for x, y in zip(b, b[1:]))


# ---- the autograd functions against autograd through the plain ops ------------------------------------------------
@pytest.mark.parametrize("kind,bias", [("swiglu", False), ("gelu", True), ("geglu", False)])
@pytest.mark.parametrize("chunk", [1, 7, 16, 200])
def test_mlp_function_matches_autograd(kind, bias, chunk):
    g = torch.Generator().manual_seed(0)
    n, h, f = 37, 16, 24
    gated = kind != "gelu"
    x = torch.randn(n, h, generator=g, requires_grad=True)
    w1 = (torch.randn(2 * f if gated else f, h, generator=g) * 0.2).requires_grad_()
    b1 = (torch.randn(w1.shape[0], generator=g) * 0.1).requires_grad_() if bias else None
    w2 = (torch.randn(h, f, generator=g) * 0.2).requires_grad_()
    up = torch.randn(n, h, generator=g)  # a non-uniform upstream gradient
    params = [t for t in (x, w1, b1, w2) if t is not None]

    hid = F.linear(x, w1, b1)
    act = {"swiglu": lambda: F.silu(hid[:, :f]) * hid[:, f:],
           "geglu": lambda: F.gelu(hid[:, :f], approximate="tanh") * hid[:, f:],
           "gelu": lambda: F.gelu(hid, approximate="tanh")}[kind]()
    ref_out = act @ w2.t()
    ref = torch.autograd.grad(ref_out, params, up)
    out = mini_sequence_mlp(x, w1, b1, w2, kind, chunk)
    got = torch.autograd.grad(out, params, up)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, 13, 64])
@pytest.mark.parametrize("mode", ["uniform", "weighted", "recompute"])
def test_head_function_matches_vocab_parallel_ce(chunk, mode, monkeypatch):
    """uniform: upstream gradient constant on labelled tokens (the training loop) -> gradient from forward;
    weighted: per-token factors -> dW recomputed chunk by chunk; recompute: grad_in_forward=False (Algorithm 4)."""
    from megatron_lc.memory.mst import head_function as mst_head

    calls = []
    real = mst_head._recompute_backward
    monkeypatch.setattr(mst_head, "_recompute_backward", lambda *a: calls.append(a[-2:]) or real(*a))
    g = torch.Generator().manual_seed(1)
    n, h, v = 41, 16, 96
    x = torch.randn(n, h, generator=g, requires_grad=True)
    w = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3:9] = -100  # ignored labels, a whole chunk of them when chunk == 5
    labels[-1] = -100
    up = torch.rand(n, generator=g) if mode == "weighted" else torch.full((n,), 1.0 / n)
    up[labels == -100] = 7.0  # whatever flows to ignored tokens must not matter
    topo = Topology()
    ref_loss = vocab_parallel_cross_entropy(x @ w.t(), labels, topo)
    ref = torch.autograd.grad(ref_loss, [x, w], up)
    loss = mini_sequence_cross_entropy(x, w, labels, topo, chunk, grad_in_forward=mode != "recompute")
    got = torch.autograd.grad(loss, [x, w], up)
    assert loss.dtype == torch.float32 and bool((loss[labels == -100] == 0).all())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert bool((got[0][labels == -100] == 0).all())  # ignored tokens get no gradient
    # which path ran: (need_x, need_w) of the backward recompute, if any
    assert calls == {"uniform": [], "weighted": [(False, True)], "recompute": [(True, True)]}[mode]


def test_head_backward_twice_and_no_grad():
    """retain_graph: the forward-computed gradient is consumed by the first backward, the second recomputes;
    under no_grad only the loss is computed."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 8, generator=g, requires_grad=True)
    w = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (30,), generator=g)
    loss = mini_sequence_cross_entropy(x, w, labels, Topology(), 7).sum()
    first = torch.autograd.grad(loss, [x, w], retain_graph=True)
    second = torch.autograd.grad(loss, [x, w])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(mini_sequence_cross_entropy(x, w, labels, Topology(), 7).sum(), loss.detach())


def test_head_loss_is_shaped_like_the_labels_and_not_a_view():
    """The loss comes back ``[s, b]`` as the Function made it: a view of an ``[N]`` loss made FSDP2 warn on every
    step (its pre-backward hook on a view is dropped by an in-place op) and the per-token values are the same."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (10, 3), generator=g)
    loss = mini_sequence_cross_entropy(x.reshape(30, 8), w, labels, Topology(), 7)
    flat = mini_sequence_cross_entropy(x.reshape(30, 8), w, labels.reshape(30), Topology(), 7)
    assert loss.shape == (10, 3) and loss._base is None
    assert torch.equal(loss.reshape(30), flat)
    gx = torch.autograd.grad((loss * torch.arange(30.0).view(10, 3)).sum(), x)[0]
    gx_flat = torch.autograd.grad((flat * torch.arange(30.0)).sum(), x)[0]
    assert torch.equal(gx, gx_flat)


# ---- the whole model -------------------------------------------------------------------------------------------
def _weighted_batch(cfg, seed=0, weighted=True):
    """Ignored labels (-100); with ``weighted`` a non-uniform loss mask, so the head's upstream gradient differs per
    token (dW recomputed in backward); without, the loop's 0/1 mask (gradient from the forward)."""
    batch = batch_for(cfg, seed)
    batch["labels"][0, :5] = -100
    batch["labels"][1, -3:] = -100
    if weighted:
        batch["loss_mask"] = torch.rand(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(seed))
    return batch


def _mst_loss_and_grads(cfg, batch):
    model = build(cfg, Topology())[0]
    tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
    loss = (tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return model, float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mlp_chunk,head_chunks,arch,weighted", [
    (16, 4, "llama", False),  # 64 tokens: 4 even MLP chunks, 4 head chunks of 16
    (7, 5, "llama", True),    # uneven: MLP 9x7 + 1, head 4x13 + 12
    (7, 5, "llama", False),
    (1, 64, "llama", True),   # one token per chunk
    (10, 3, "gpt", False),    # GeLU, biases, tied embedding/output weight, learned positions
])
def test_model_matches_unchunked(mlp_chunk, head_chunks, arch, weighted):
    cfg = small_config(["memory.mst=true", f"memory.mst_mlp_chunk_size={mlp_chunk}",
                        f"memory.mst_head_chunks={head_chunks}"] + (GPT if arch == "gpt" else []))
    batch = _weighted_batch(cfg, weighted=weighted)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    model, loss, grads = _mst_loss_and_grads(cfg, batch)
    assert isinstance(model.layers[0].mlp, MiniSequenceMLP) and isinstance(model.head, MiniSequenceLMHead)
    assert_close_loss(loss, ref_loss)
    assert_close_grads(grads, ref_grads)


def test_model_under_layer_checkpoint_matches_unchunked():
    """MsT inside recomputed layers (torch.utils.checkpoint around each layer: the MLP function runs again in
    backward's recompute) -- the `mst+layer_checkpoint` row of bench/activation_bytes.py."""
    cfg = small_config(["memory.mst=true", "memory.mst_mlp_chunk_size=7", "memory.mst_head_chunks=5"])
    batch = _weighted_batch(cfg, weighted=False)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    model, _ = build(cfg, adjust_spec=with_layer_checkpoint)
    tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
    ((tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
    assert_close_loss(float((tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()), ref_loss)
    assert_close_grads({n: p.grad for n, p in model.named_parameters()}, ref_grads)


@pytest.mark.parametrize("memory", [["memory.recompute_granularity=full"],
                                    ["memory.recompute_granularity=selective"],
                                    ["memory.activation_offload=memo", "memory.offload_fraction=0.5"]])
def test_model_with_recompute_and_offload_matches_unchunked(memory):
    """MsT inside the token-wise layer executors (full / selective recompute, Memo offload with half the tokens
    recomputed): the MLP function runs on token subsets in the recompute."""
    cfg = small_config(["memory.mst=true", "memory.mst_mlp_chunk_size=7", "memory.mst_head_chunks=5"] + memory)
    batch = _weighted_batch(cfg)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    _, loss, grads = _mst_loss_and_grads(cfg, batch)
    assert_close_loss(loss, ref_loss)
    assert_close_grads(grads, ref_grads)


def test_parameter_names_and_values_unchanged():
    cfg = small_config(["memory.mst=true"])
    plain = small_config([])
    a, b = build(cfg, Topology())[0], build(plain, Topology())[0]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- chunk rules -----------------------------------------------------------------------------------------------
def test_default_chunk_rules_follow_the_paper():
    cfg = small_config(["memory.mst=true", "model.hidden_size=256", "model.ffn_hidden_size=896",
                        "model.vocab_size=32000", "model.make_vocab_size_divisible_by=128"])
    assert mst_mod.mlp_chunk_tokens(cfg) == 256  # C = d
    assert mst_mod.head_chunk_count(cfg) == math.ceil(32000 / 256) == 125  # M = V / d
    assert head_chunk_tokens(100_000, 125, explicit=False) == 800  # ceil(N / M)
    assert head_chunk_tokens(16384, 125, explicit=False) == MIN_HEAD_CHUNK == 256  # floor of the default
    assert head_chunk_tokens(100, 125, explicit=False) == 100  # short: one chunk
    assert head_chunk_tokens(100, 125, explicit=True) == 1  # an explicit M is honoured


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


def test_short_sequences_are_not_chunked(monkeypatch):
    mlp, ce = _Counter(mst_mod.mini_sequence_mlp), _Counter(mst_mod.mini_sequence_cross_entropy)
    monkeypatch.setattr(mst_mod, "mini_sequence_mlp", mlp)
    monkeypatch.setattr(mst_mod, "mini_sequence_cross_entropy", ce)
    cfg = small_config(["memory.mst=true"])  # h = 64, 2 x 32 = 64 tokens: not longer than one MLP chunk
    _, loss, _ = _mst_loss_and_grads(cfg, _weighted_batch(cfg))
    assert (mlp.calls, ce.calls) == (0, 0)
    cfg = small_config(["memory.mst=true", "memory.mst_mlp_chunk_size=63"])  # one token more than a chunk
    _mst_loss_and_grads(cfg, _weighted_batch(cfg))
    assert mlp.calls == cfg.model.num_layers


class _BigTensors(TorchDispatchMode):
    """Records every op output that holds >= ``rows`` token rows of width in ``widths`` (an intermediate that
    exists whole for the sequence)."""

    def __init__(self, rows: int, widths: set):
        super().__init__()
        self.rows, self.widths, self.seen = rows, widths, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.widths \
                    and t.numel() // t.shape[-1] >= self.rows:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("mst", [False, True])
def test_big_intermediates_never_exist_whole(mst):
    """No (tokens x ffn) or (tokens x vocab) tensor in forward or backward with MsT; the check does see them in
    the plain model (so it is not vacuous). 96 tokens, h = 64, qkv 128, ffn 160 (SwiGLU fc1 out 320), vocab 256:
    distinct widths, and every weight has fewer than 96 rows."""
    cfg = small_config(["data.seq_length=48", "model.ffn_hidden_size=160", f"memory.mst={mst}",
                        "memory.mst_mlp_chunk_size=16", "memory.mst_head_chunks=6"])
    model = build(cfg, Topology())[0]
    batch = _weighted_batch(cfg)
    m = cfg.model
    spy = _BigTensors(rows=96, widths={m.ffn_hidden_size, 2 * m.ffn_hidden_size, m.padded_vocab_size})
    with spy:
        tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
        (tok * batch["loss_mask"]).sum().backward()
    assert bool(spy.seen) != mst, spy.seen[:5]


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def test_bf16_weights_gradients_are_summed_over_chunks_in_fp32():
    """Under FSDP2 with bf16 all-gathers the functions get bf16 weights: 32 chunk partials of a weight gradient summed
    in bf16 lost ~3 bits (measured: 2x to 3.2x the unchunked bf16 linear's error against fp64); summed in fp32 and
    cast once they stay within 1.3x of it (measured: 1.1x to 1.25x). Gradients come back in the weight's dtype."""
    g = torch.Generator().manual_seed(0)
    n, h, f, v, chunk = 4096, 64, 96, 512, 128
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(2 * f, h, generator=g) * 0.2).bfloat16().requires_grad_()
    w2 = (torch.randn(h, f, generator=g) * 0.2).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.2).bfloat16().requires_grad_()
    up = torch.randn(n, h, generator=g).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)

    def mlp(x, w1, w2):
        hid = x @ w1.t()
        return (F.silu(hid[:, :f]) * hid[:, f:]) @ w2.t()

    chunked = torch.autograd.grad(mini_sequence_mlp(x, w1, None, w2, "swiglu", chunk), (w1, w2), up)
    chunked += torch.autograd.grad(mini_sequence_cross_entropy(x, w, labels, Topology(), chunk).sum(), (w,))
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w)]
    whole = torch.autograd.grad(mlp(*leaves[:3]), leaves[1:3], up)
    whole += torch.autograd.grad(F.cross_entropy((leaves[0] @ leaves[3].t()).float(), labels, reduction="sum"),
                                 leaves[3:])
    exact = [t.detach().double().requires_grad_() for t in (x, w1, w2, w)]
    ref = torch.autograd.grad(mlp(*exact[:3]), exact[1:3], up.double())
    ref += torch.autograd.grad(F.cross_entropy(exact[0] @ exact[3].t(), labels, reduction="sum"), exact[3:])
    for name, got, base, r in zip(("fc1", "fc2", "head"), chunked, whole, ref):
        assert got.dtype == torch.bfloat16, name
        assert _relative_error(got, r) <= 1.3 * _relative_error(base, r), (name, _relative_error(got, r),
                                                                          _relative_error(base, r))
