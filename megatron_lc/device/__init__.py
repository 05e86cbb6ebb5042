"""The device and its host, for the memory techniques: ``adapter.py`` (``DeviceAdapter``: pinned host memory, side
streams, events, with a CPU twin), ``host_pool.py`` (``HostPool``: the offload techniques' one host allocation),
``host_budget.py`` (what a rank may give that pool: ``host_budget``, ``HostMemoryError``), ``account.py``
(``BufferAccount``: the framework's count of the device buffers it creates), ``storage.py`` (``storage_id``: a
storage by identity, never by address), ``stream_check.py`` (``StreamCheck``: the CPU twin that also checks the order
of streams, events, copies and frees, as a GPU would run them; ``op_access.py``: the bytes each op reads and writes).
The memory code (FPDT offload, Memo rounding buffers, host checkpoints) is written once against these; the tests run
the CPU twin::

    dev = DeviceAdapter.for_device(torch.device("cpu"))
    pool = HostPool(); pool.bind(dev); pool.reserve("fpdt", 1 << 20)   # sized by the calibrations
    host = pool.take((1024, 64), torch.float32)           # a view of the one pinned allocation (plain on CPU)
    offload, prefetch = dev.copy_streams()                # the device's two copy streams, shared
    with dev.stream(offload):
        host.copy_(x, non_blocking=True)
    ev = dev.record_event(offload)                         # later: dev.wait_event(ev) before reusing x
"""
from .account import BufferAccount
from .adapter import DeviceAdapter, use_adapter
from .host_budget import HostMemoryError, host_budget, host_share, pool_budget_error, ranks_on_this_node
from .host_pool import HostPool, HostPoolError
from .storage import has_values, storage_id
from .stream_check import StreamCheck, StreamViolation

__all__ = ["BufferAccount", "DeviceAdapter", "HostMemoryError", "HostPool", "HostPoolError", "StreamCheck",
           "StreamViolation", "has_values", "host_budget", "host_share", "pool_budget_error", "ranks_on_this_node",
           "storage_id", "use_adapter"]
