"""What torch.distributed receives on a GPU run: NCCL takes device tensors only, so a CUDA run uses the process
group ``cpu:gloo,cuda:nccl`` (the step's CPU flags and counts go to gloo), and every tensor collective of a training
step is issued from a known place with tensors on the training device or on the host.

On this CPU machine the training device *is* the host, so the device rule cannot fail here; what can fail is a
collective issued from a new place (it must be added below, with a look at the device of what it sends) and the
backend choice (tested with the device mocked)."""
import pytest
import torch

from megatron_lc.config import load_config
from megatron_lc.training.process_group import process_group_backend
from tests.dist_cases import collectives as dc
from tests.support.dist import run_dist

# where tensor collectives may be issued, and why the tensor's device is right there
SITES = {
    "parallel/collectives.py": "activations / gradients on the training device; step scalars on the host (gloo)",
    "attention/ring.py": "k/v blocks and dk/dv: activations on the training device",
    "attention/ulysses.py": "q/k/v and outputs: activations on the training device",
    "training/faults.py": "the step's stop flags: host int64 (gloo side)",
    "torch:zero_redundancy_optimizer.py": "ZeRO-1 broadcasts updated parameters: on the training device",
}
LAYOUTS = {  # world -> overrides
    "tp2-sp": (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "ring-cp2": (2, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"]),
    "ulysses-cp2": (2, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"]),
    "fpdt-cp2": (2, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8"]),
    "dp2-zero1-memo": (2, ["parallel.use_distributed_optimizer=true", "memory.activation_offload=memo",
                           "memory.offload_fraction=0.25"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_collectives_come_from_known_sites_on_allowed_devices(name):
    world, overrides = LAYOUTS[name]
    for calls, device in run_dist(world, dc.record_step, overrides):
        assert calls, "the step issued no collective"
        for fn, site, devices in calls:
            assert site in SITES, f"{fn} issued from {site}: not a known collective site"
            assert set(devices) <= {torch.device(device).type, "cpu"}, (fn, site, devices)


def test_process_group_backend_per_device():
    cfg = load_config(None, ["data.mock_data=true"])
    assert process_group_backend(cfg, torch.device("cpu")) == "gloo"
    assert process_group_backend(cfg, torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    named = load_config(None, ["data.mock_data=true", "parallel.distributed_backend=nccl"])
    assert process_group_backend(named, torch.device("cuda", 0)) == "nccl"  # named: as named


def test_sequence_parallels_reduce_scatter_is_the_device_backends(monkeypatch):
    """A CUDA run's groups are ``cpu:gloo,cuda:nccl``: ``dist.get_backend(group)`` names both, never ``nccl`` -- the
    check that chose NCCL's reduce-scatter by that name never did, and every SP reduce-scatter was a clone, an
    all-reduce (twice the bytes) and a slice. Played with the rehearsal's ``cpu:fake,standin:fake`` (its stand-in
    device in CUDA's place) and a counting wrapper of both calls: a device tensor goes to ``reduce_scatter_tensor``
    (1/tp of it comes back), a host tensor to gloo's all-reduce and slice."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_lc.parallel import collectives
    from megatron_lc.parallel.topology import Axis, Topology
    from megatron_lc.rehearsal.standin import install
    from megatron_lc.rehearsal.world import fake_world

    device = install()
    calls = []
    real_rs, real_ar = collectives._reduce_scatter, torch.distributed.all_reduce
    monkeypatch.setattr(collectives, "_reduce_scatter", lambda *a, **k: (calls.append("reduce_scatter"),
                                                                         real_rs(*a, **k))[1])
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: (calls.append("all_reduce"),
                                                                         real_ar(*a, **k))[1])
    with fake_world(0, 2, 2, device):
        topo = Topology.build(tp=2)
        assert torch.distributed.get_backend(topo.group(Axis.TP)) == "cpu:fake,standin:fake"
        with FakeTensorMode():
            out = collectives.reduce_scatter(torch.empty(8, 3, device=device), topo, Axis.TP)
            assert out.shape == (4, 3) and out.device == device and calls == ["reduce_scatter"]
            host = collectives.reduce_scatter(torch.empty(8, 3), topo, Axis.TP)
            assert host.shape == (4, 3) and calls == ["reduce_scatter", "all_reduce"]
    assert topo.comm.bytes[("untagged", "reduce_scatter")] == 2 * 8 * 3 * 4 // 2  # reduce-scatter's volume, both times
