"""Causal sliding windows (``model.sliding_window``, per layer with ``model.layer_types``) on every attention path
and memory technique equal the dense masked reference (tests/dist_cases/windows.py), with windows smaller and
larger than a ring chunk, alone and with packed documents; and no path builds a tensor with a query and a key
dimension or reads a device value inside the step under masks.

Tolerances (tests/support/parity.py): loss 1e-5 relative, every gradient 1e-4 absolute. The decomposition into
rectangles changes only the order of the fp32 softmax sums (merged by lse, ~1e-7 relative per merge)."""
import pytest
import torch

from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.estimate.dims import Dims
from megatron_lc.training.metrics import step_counts
from tests.dist_cases import windows as dw
from tests.support.dist import run_dist

SMALL = ["model.sliding_window=3"]  # below a ring chunk (8 tokens at cp 2, 4 at cp 4) and an FPDT chunk (8)
LARGE = ["model.sliding_window=12", "model.layer_types=sliding_attention,full_attention"]  # above; layer 1 full
RING2 = ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"]
FPDT = ["parallel.cp_comm_type=fpdt", "parallel.context_parallel_size=2", "memory.fpdt_chunk_size=8"]
MEMO = ["memory.activation_offload=memo", "memory.offload_fraction=0.25"]
CHECKPOINTS = ["memory.activation_offload=checkpoints"]
LENGTHS = [[5, 1, 12, 9, 20], [40]]  # tests/attention/test_documents.py's

# world -> (overrides, tp, document lengths or None)
CASES = {
    1: [(SMALL, 1, None), (LARGE, 1, None), (SMALL + ["memory.recompute_granularity=full"], 1, None),
        (SMALL + ["memory.recompute_granularity=selective"], 1, None), (SMALL + MEMO, 1, None),
        (SMALL + ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=4"], 1, None),
        (SMALL + CHECKPOINTS, 1, None), (SMALL + CHECKPOINTS + ["memory.layer_chunk_size=8"], 1, None),
        (SMALL, 1, LENGTHS), (LARGE, 1, LENGTHS)],
    2: [(RING2 + SMALL, 1, None), (RING2 + LARGE, 1, None), (RING2 + SMALL + ["memory.recompute_granularity=full"], 1,
                                                                None),
        (RING2 + SMALL + MEMO, 1, None), (RING2 + SMALL + CHECKPOINTS, 1, None),
        (["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"] + SMALL, 1, None),
        (FPDT + SMALL + ["memory.fpdt_offload=false"], 1, None), (FPDT + LARGE + ["memory.fpdt_offload=true"], 1, None),
        (FPDT + SMALL + ["memory.fpdt_offload=true", "memory.recompute_granularity=full"], 1, None),
        (SMALL + ["parallel.sequence_parallel=true"], 2, None),
        (RING2 + SMALL, 1, LENGTHS), (FPDT + LARGE, 1, LENGTHS)],
    4: [(["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p"] + SMALL, 1, None),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p"] + LARGE, 1, None),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a", "model.num_query_groups=2"] + SMALL, 1,
         None),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2"] + SMALL, 1,
         None),
        (["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2"] + LARGE, 1,
         LENGTHS),
        (FPDT + ["memory.fpdt_chunk_size=4", "memory.fpdt_offload=true"] + MEMO + SMALL, 2, None)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_windows_match_the_dense_masked_model(world):
    run_dist(world, dw.window_parity_cases, CASES[world])


WATCHED = {1: [[]], 2: [["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"],
                        ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"],
                        ["parallel.cp_comm_type=fpdt", "parallel.context_parallel_size=2",
                         "memory.fpdt_chunk_size=128", "memory.fpdt_offload=true"]]}


@pytest.mark.parametrize("world", sorted(WATCHED))
def test_no_query_by_key_tensor_and_no_value_read_under_masks(world):
    """512 tokens, documents of 100, 3, 250 and the rest, a window of 48 on layer 0: no op output has two
    dimensions above 64 (every model dimension is at most 64, so such a tensor is [queries, keys]: a mask, a bias,
    scores), and no op reads a device value (a host sync on a GPU)."""
    for over in WATCHED[world]:
        over = over + ["model.sliding_window=48", "model.layer_types=sliding_attention,full_attention"]
        for big, reads in run_dist(world, dw.watched_step, over, [100, 3, 250, 200]):
            assert not big, (over, big[:3])
            assert not reads, (over, reads[:3])


@pytest.mark.parametrize("backend", ["flash", "te"])
def test_windows_refused_with_kernels_that_take_no_rectangles(backend):
    """One line naming both keys, before anything is built."""
    cfg = load_config(None, ["data.mock_data=true", "model.sliding_window=64", f"parallel.attention_backend={backend}"])
    with pytest.raises(ConfigError, match=rf"model.sliding_window with parallel.attention_backend={backend}") as e:
        resolve_layout(cfg, 1)
    assert "\n" not in str(e.value)


def test_layer_types_give_each_layer_its_window():
    cfg = load_config(None, ["data.mock_data=true", "model.num_layers=4", "model.sliding_window=1024",
                             "model.layer_types=sliding_attention,sliding_attention,sliding_attention,full_attention"])
    assert resolve_layout(cfg, 1).windows == (1024, 1024, 1024, None)
    assert load_config(None, ["model.num_layers=2", "model.sliding_window=8"]).model.attention_windows() == (8, 8)
    with pytest.raises(ConfigError, match="layer_types has 1 entries for model.num_layers"):
        load_config(None, ["model.num_layers=2", "model.sliding_window=8", "model.layer_types=full_attention"])
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        load_config(None, ["model.num_layers=1", "model.layer_types=sliding_attention"])


def test_flops_count_the_window():
    """MFU's pairs (host integers) and the estimator's attended keys with a window W < s: a sample of s tokens has
    W^2/2 + (s - W) W pairs; two layers, one full: the mean."""
    s, w = 64, 16
    cfg = load_config(None, ["data.mock_data=true", f"data.seq_length={s}", "model.num_layers=2",
                             f"model.sliding_window={w}", "model.layer_types=sliding_attention,full_attention"])
    layout = resolve_layout(cfg, 1)
    batch = {"tokens": torch.zeros(2, s, dtype=torch.long), "loss_mask": torch.ones(2, s)}
    counts = step_counts([batch], layout)
    assert float(counts[1]) == 2 * (w * w / 2 + (s - w) * w + s * s / 2) / 2 and float(counts[2]) == 1
    dims = Dims.from_config(cfg, layout, "cpu")
    assert dims.attended == (2 * w - w * w / s + s) / 2 and dims.earlier_chunks(4) == (3 + 6) / 2
