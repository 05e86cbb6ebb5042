"""A run, top to bottom: ``process_group.py`` (process group, device), ``setup.py`` (everything before step 1, in
order), ``loop.py`` (the steps) with ``batches.py`` (a step's micro-batches), ``optimizer.py``, ``metrics.py`` (MFU,
throughput) and ``logger.py``; ``checkpointing/`` (save, resume at any layout), ``eval/`` (validation, loss by
position, passkey), ``faults.py`` (signals, time limit, non-finite steps) and ``errors.py`` (the one-line errors that
end a run), ``launcher.py`` (``--nproc-per-node``), ``entry.py`` (``pretrain_gpt.py``'s body)."""
