"""FPDT's chunked Ulysses attention block with host offload and double buffering: ``block.py`` (the module the model
spec constructs), ``pipeline.py`` (forward / backward over chunk pairs), ``buffers.py`` (device buffers, host store,
prefetch), ``project.py`` (per-chunk QKV projection), ``runtime.py`` (``FPDTRuntime``, its technique runtime),
``host_share.py`` (its share of the host pool, measured)."""
