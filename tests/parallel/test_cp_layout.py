"""Sequence layouts of the data path and the clear errors for lengths / heads that do not split."""
import pytest
import torch

from megatron_lc.attention import build_core_attention
from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.config.layout import kv_replication
from megatron_lc.parallel.token_layout import local_token_index, shard_batch
from megatron_lc.parallel.topology import Topology
from tests.support.parity import batch_for, small_config


def _cfg(kind, cp, ulysses=None, s=16, extra=()):
    o = [f"parallel.context_parallel_size={cp}", f"parallel.cp_comm_type={kind}", f"data.seq_length={s}"]
    if ulysses is not None:
        o.append(f"parallel.ulysses_size={ulysses}")
    return small_config(o + list(extra))


def _rows(cfg, s):
    p = cfg.parallel
    world = p.context_parallel_size
    layout = resolve_layout(cfg, world)
    return [local_token_index(layout, Topology(world_size=world, rank=r, cp=world, ulysses=p.ulysses_size), s).tolist()
            for r in range(world)]


def test_zigzag_ring_layout():
    assert _rows(_cfg("p2p", 4), 16) == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_contiguous_ulysses_layout():
    assert _rows(_cfg("a2a", 2, s=8), 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hybrid_layout_is_zigzag_over_ring_then_contiguous_over_ulysses():
    # cp rank = ring * U + ulysses; ring 0 holds chunks 0 and 3 of 4, ring 1 chunks 1 and 2
    assert _rows(_cfg("a2a+p2p", 4, 2), 16) == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("kind,cp,ulysses", [("p2p", 2, None), ("p2p", 4, None), ("a2a", 4, None),
                                             ("a2a+p2p", 4, 2), ("a2a+p2p", 8, 2)])
def test_layout_is_a_partition(kind, cp, ulysses):
    s = 32
    rows = _rows(_cfg(kind, cp, ulysses, s=s), s)
    assert sorted(sum(rows, [])) == list(range(s))
    assert len({len(r) for r in rows}) == 1


def test_shard_batch_moves_tokens_labels_positions_and_mask_together():
    cfg = _cfg("p2p", 2, s=8)
    batch = batch_for(cfg)
    batch["loss_mask"] = torch.arange(16.0).view(2, 8)
    topo = Topology(world_size=2, rank=1, cp=2)
    out = shard_batch(batch, resolve_layout(cfg, 2), topo)
    idx = torch.tensor([2, 3, 4, 5])  # rank 1 of cp=2: chunks 1 and 2 of 4
    for k in ("tokens", "labels", "position_ids", "loss_mask"):
        assert torch.equal(out[k], batch[k][:, idx]), k


@pytest.mark.parametrize("kind,cp,ulysses,s,mult", [("p2p", 2, None, 30, 4), ("p2p", 4, None, 36, 8),
                                                     ("a2a", 4, None, 30, 4), ("a2a+p2p", 4, 2, 36, 8)])
def test_sequence_not_divisible_is_refused(kind, cp, ulysses, s, mult):
    """Both the config check (before training) and the data path (a batch of another length) refuse clearly."""
    with pytest.raises(ConfigError, match=rf"data.seq_length \({s}\) must be divisible by {mult}"):
        resolve_layout(_cfg(kind, cp, ulysses, s=s), cp)
    cfg = _cfg(kind, cp, ulysses, s=64)  # valid config, but a batch of length s arrives
    topo = Topology(world_size=cp, rank=0, cp=cp, ulysses=cfg.parallel.ulysses_size)
    with pytest.raises(ConfigError, match=rf"sequence length \({s}\) must be divisible by {mult}"):
        shard_batch(batch_for(_cfg(kind, cp, ulysses, s=s)), resolve_layout(cfg, cp), topo)


def test_heads_not_divisible_by_ulysses_is_refused():
    with pytest.raises(ConfigError, match=r"attention heads per tp rank \(6\) must be divisible by ulysses size \(4\)"):
        resolve_layout(_cfg("a2a", 4, extra=["model.num_attention_heads=6", "model.num_query_groups=2",
                                             "model.hidden_size=48"]), 4)
    with pytest.raises(ConfigError, match=r"\(6\) must be divisible by ulysses size \(4\)"):
        kv_replication(6, 2, 4)


@pytest.mark.parametrize("nq,nkv,u,rep", [(8, 8, 4, 1), (8, 4, 4, 1), (8, 2, 4, 2), (8, 1, 4, 4), (6, 2, 3, 3),
                                          (8, 4, 8, 2)])
def test_kv_replication(nq, nkv, u, rep):
    assert kv_replication(nq, nkv, u) == rep


@pytest.mark.parametrize("path,world", [("configs/tiny_cpu_cp_ring.yaml", 2), ("configs/tiny_cpu_cp_ulysses.yaml", 2),
                                        ("configs/tiny_cpu_cp_hybrid.yaml", 4)])
def test_cp_configs_load_and_fit_their_world(path, world):
    cfg = load_config(path)
    assert resolve_layout(cfg, world).dp == 1
    assert cfg.parallel.context_parallel_size == world


def test_missing_gpu_attention_backend_is_a_config_error():
    # a GPU run's config (a CPU run refuses a CUDA-only backend when it loads: config/combinations.py)
    cfg = _cfg("p2p", 2, extra=["parallel.attention_backend=te", "train.device=cuda"])
    with pytest.raises(ConfigError, match="parallel.attention_backend te needs a package that is not installed"):
        build_core_attention(resolve_layout(cfg, 2), Topology(world_size=2, rank=0, cp=2), "te", layer_number=0)
