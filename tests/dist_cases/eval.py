"""Rank functions for tests/training/eval/test_eval_long.py (run under tests.support.dist.run_dist), and the model that
knows a passkey.

Tolerance of the per-token losses: 1e-5 relative per token (tests/support/parity.py's loss contract). A parallel layout
changes only the order of fp32 reductions (tp partial sums, the softmax of attention merged by lse over ring blocks,
the vocab-parallel log-sum-exp), ~1e-7 relative each; through 2 layers a token's loss (~5.5 = log 256 on a random
model) moves by ~1e-6 relative. The argmax of the logits is compared exactly: on a random model the two largest
logits of a position differ by ~1e-2, far above those ~1e-6 changes."""
from __future__ import annotations

import torch

from megatron_lc.config import resolve_layout
from megatron_lc.parallel.tensor_parallel import shard_full_tensor
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.eval.by_position import predict_tokens, token_losses_global
from megatron_lc.training.eval.passkey import PasskeyPrompt, evaluate_passkey, passkey_key
from tests.support.parity import batch_for, build, small_config

# rows of predict_tokens' positions: any order, a repeat, -1 = none
POSITIONS = [[0, 7, 16, 31], [31, 3, 3, -1]]
PASSKEY = {"length": 32, "depth": 0.5, "digits": 5}  # one cell of the passkey grid, the small config's length


def known_key_seeds() -> tuple[int, int]:
    """(seed whose key the bigram model learns, seed of a key with another first digit). The bigram model maps each
    answer input to the next key token, so the first four digits of the known key must differ."""
    def key(seed):
        return passkey_key(seed, PASSKEY["length"], PASSKEY["depth"], 0, PASSKEY["digits"])

    known = next(s for s in range(100) if len(set(key(s)[:4])) == 4)
    other = next(s for s in range(100) if key(s)[0] != key(known)[0])
    return known, other


def bigram_state(cfg, key: str) -> dict:
    """Full weights of ``cfg``'s model changed, before it evaluates anything, into one that knows ``key``: the
    attention and MLP outputs are zero, so the final hidden state of a token is its embedding; the question's last
    token and key digits 0..3 get one-hot embeddings (slots 0..4) and the output layer maps slot i to key digit i
    (logit sqrt(h) = 8 after RMSNorm, every other logit 0). Teacher-forced, it predicts every key token; any
    other key's first token is wrong."""
    model = build(cfg)[0]
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, t in state.items():
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            t.zero_()
    prompt = PasskeyPrompt.token_ids(cfg.model.vocab_size)
    answer = prompt.key_tokens(key)[1]
    emb, out = state["embedding.weight"], state["head.output_layer.weight"].zero_()
    for slot, (a, b) in enumerate(zip((prompt.question[-1], *answer[:-1]), answer)):
        emb[a] = 0.0
        emb[a, slot] = 1.0
        out[b, slot] = 1.0
    return state


def load_full_state(model, state: dict, topo: Topology) -> None:
    """Copy a full (unsharded) state into ``model``, cutting each parameter's tp shard."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_full_tensor(state[name], p, topo))


def passkey_accuracy(model, cfg, layout, topo, seed: int) -> tuple[float, float]:
    v = cfg.model.vocab_size
    r = evaluate_passkey(model, PasskeyPrompt.token_ids(v), [PASSKEY["length"]], [PASSKEY["depth"]], 1,
                         PASSKEY["digits"], seed, cfg.data.seq_length, v, layout, topo, torch.device("cpu"))
    return r["accuracy"][0][0], r["token_accuracy"][0][0]


def layout_case(rank, world, overrides, known_state, known_seed, other_seed):
    """Under the layout of ``overrides``: per-token losses in global order, the argmax at ``POSITIONS`` and the
    single-process model's; then passkey accuracies of the bigram model for its own key and another."""
    cfg = small_config(list(overrides))
    layout = resolve_layout(cfg, world)
    p = cfg.parallel
    topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size)
    batch = batch_for(cfg, seed=3)
    ref = build(small_config())[0]  # the plain single-process model: same seed, same full weights
    with torch.no_grad():
        ref_loss = ref(batch["tokens"], batch["position_ids"], batch["labels"])  # [b, s]
        logits = ref(batch["tokens"], batch["position_ids"])  # [b, s, V]
    logits[..., cfg.model.vocab_size:] = float("-inf")  # padding ids are not tokens
    positions = torch.tensor(POSITIONS)
    ref_pred = torch.stack([logits[i, positions[i].clamp(min=0)].argmax(-1) for i in range(len(POSITIONS))])
    ref_pred[positions < 0] = -1

    model = build(cfg, topo)[0]
    losses = token_losses_global(model, batch, layout, topo)
    pred = predict_tokens(model, batch, positions, layout, topo, cfg.model.vocab_size)

    load_full_state(model, known_state, topo)
    known = passkey_accuracy(model, cfg, layout, topo, known_seed)
    other = passkey_accuracy(model, cfg, layout, topo, other_seed)
    return {"losses": losses, "ref_losses": ref_loss, "pred": pred, "ref_pred": ref_pred, "known": known,
            "other": other}
