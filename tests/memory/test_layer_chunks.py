"""``memory.layer_chunk_size``: token-wise recompute / Memo re-runs a layer's token-wise parts (pre: norm, QKV, RoPE;
post: out-proj, residual, norm, MLP) in mini-sequences, so outside core attention the recompute holds O(chunk) rows.

Exactness: every op in those parts is row-wise, so a chunk's rows are the rows of the whole; only the GEMM blocking
of a smaller M may change the last bits (fp32, ~1e-7 relative) -- measured: loss equal, grads <= 1e-8 absolute;
asserted at the contract (loss 1e-5 relative, grads 1e-4)."""
from __future__ import annotations

import pytest

from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases import fsdp as cases
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads, assert_close_loss

FULL = ["memory.recompute_granularity=full"]


@pytest.fixture(scope="module")
def reference():
    return cases.first_step_grads(0, 1, ["train.micro_batch_size=4"])


@pytest.mark.parametrize("world,overrides", [
    (1, FULL + ["memory.layer_chunk_size=24", "train.micro_batch_size=4"]),  # 64 tokens: 24 + 24 + 16
    (1, ["memory.activation_offload=memo", "memory.offload_fraction=0.25", "memory.mst=true",
         "memory.layer_chunk_size=16", "train.micro_batch_size=4"]),
    (2, FULL + ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                "memory.layer_chunk_size=10", "train.micro_batch_size=4"]),  # 32 rows per rank, gathered x 2
], ids=["full-uneven", "memo-a0.25-mst", "tp2-sp"])
def test_chunks_equal_the_plain_model(reference, world, overrides):
    got = (cases.first_step_grads(0, 1, overrides) if world == 1
           else run_dist(world, cases.first_step_grads, overrides)[0])
    assert_close_loss(got["loss"], reference["loss"])
    assert_close_grads(got["grads"], reference["grads"])


def _recompute_peak(chunk):
    sets = cases.TINY + FULL + ["data.seq_length=512", "train.micro_batch_size=1", "train.global_batch_size=1",
                                "train.train_iters=1", "checkpoint.save=null"]
    t = Trainer(load_config(None, sets + ([f"memory.layer_chunk_size={chunk}"] if chunk else [])), Topology())
    t.train()
    return t.ctx.memo.account.peak_by_tag["memo.recompute"]


def test_recompute_working_set_is_per_chunk():
    """The bytes the recompute of one mini-sequence saves (the framework's account, ``memo.recompute``) scale with
    the chunk, not with the 512 tokens."""
    whole, c64, c16 = _recompute_peak(None), _recompute_peak(64), _recompute_peak(16)
    assert c64 == 4 * c16, (c64, c16)
    assert c16 * 8 <= whole, (c16, whole)


@pytest.mark.parametrize("extra,keys", [
    ([], ["layer_chunk_size", "recompute_granularity"]),
    (FULL + ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=32"],
     ["layer_chunk_size", "cp_comm_type"]),
])
def test_refused_without_token_wise_recompute_or_with_fpdt(extra, keys):
    with pytest.raises(ConfigError) as e:
        resolve_layout(load_config(None, cases.TINY + ["memory.layer_chunk_size=16"] + extra), 2)
    assert "\n" not in str(e.value) and all(k in str(e.value) for k in keys), str(e.value)


def test_each_layer_drops_its_kept_tensors_when_its_backward_is_done(monkeypatch):
    """Token-wise recompute keeps every layer's input and attention output in its ``LayerStep``, which sits on
    autograd's ctx until the whole graph goes: without ``backward_done`` dropping them, the first layer's backward
    still held every layer's (the calibration case ``recompute-full-chunks`` measured 87.2 MiB then, 77.4 now). When
    the embedding's gradient arrives (every layer's backward done, the graph still alive) no step holds a tensor."""
    from megatron_lc.memory.memo.executor import MemoExecutor

    steps, held = [], []
    spy = MemoExecutor._step

    def record(self, *args, **kwargs):
        st, rope_a = spy(self, *args, **kwargs)
        steps.append(st)
        return st, rope_a

    monkeypatch.setattr(MemoExecutor, "_step", record)
    cfg = load_config(None, cases.TINY + FULL + ["memory.layer_chunk_size=16", "train.micro_batch_size=4",
                                                 "checkpoint.save=null"])
    t = Trainer(cfg, Topology())
    def at_embedding_grad(g):
        held.extend((st.layer.layer_number, st.h_input is not None or st.h_attn is not None) for st in steps)

    t.model.embedding.register_forward_hook(lambda m, args, out: out.register_hook(at_embedding_grad) and None)
    t.forward_backward(t.microbatches(0))
    assert len(held) == cfg.model.num_layers and not any(h for _, h in held), held
