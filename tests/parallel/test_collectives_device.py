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
