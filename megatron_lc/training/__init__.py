"""A run, top to bottom: ``runtime.py`` (process group, device), ``setup.py`` (everything before step 1, in
order), ``loop.py`` (the steps) with ``batches.py`` (a step's micro-batches), ``optimizer.py``, ``metrics.py`` (MFU,
throughput) and ``logger.py``; ``checkpoint.py`` + ``checkpoint_dir.py`` + ``sharded_state.py`` + ``reshard.py``
(save, resume at any layout), ``faults.py`` (signals, time limit, non-finite steps), ``evaluate.py`` +
``passkey.py`` (long-context evaluation), ``entry.py`` (``pretrain_gpt.py``'s body)."""
