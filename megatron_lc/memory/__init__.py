"""Run-time memory techniques, each in its home: ``mst/`` (mini-sequence MLP and LM head + loss), ``memo/``
(token-wise recompute and Memo offload, its calibration), ``recompute.py`` (torch-checkpoint executors: selective,
whole-layer), ``arena.py`` (framework buffers from a planned arena). The model spec (``parallel/parallelize.py``)
constructs them; offline memory planning is the ``planning`` package."""
