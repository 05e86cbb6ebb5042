"""The rehearsal (megatron_lc/rehearsal, tools/rehearse.py): the real setup and step under fake tensors and a fake
process group -- every layout family on 8 simulated ranks of the tiny model to the end of 2 steps, a host tensor
in device math reported (and unnoticed by an ordinary CPU run), the summary line as documented."""
from __future__ import annotations

import re

from tests import dist_cases_rehearsal as cases
from tests.dist import run_dist


def test_a_host_tensor_in_device_math_is_reported_by_the_rehearsal_only():
    got = run_dist(1, cases.host_math_fault)[0]
    assert got["clean_rehearsal"] == []
    # the host copy is also read without waiting for its offload's event: the stream check may report that too
    host = [v for v in got["violations"] if v["kind"] == "host pool used in device math"]
    sites = {v["site"].split(":", 1)[0] for v in host}
    assert host and "megatron_lc/model/norm.py" in sites, got["violations"]
    assert got["faulty"] == got["clean"]  # on the CPU the same memory: the ordinary run cannot see it
