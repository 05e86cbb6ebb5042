"""Run-time memory techniques, each in its home; the model spec (``compose/spec.py``) constructs them and
``compose/context.py`` holds their runtimes. Offline memory planning is the ``planning`` package.

    mst/                   mini-sequence MLP and LM head + loss (Mini-Sequence Transformer)
    memo/                  token-wise recompute and Memo offload: executor, steps, slots, offload (MemoRuntime),
                           the alpha LP, the calibration
    recompute.py           torch-checkpoint executors: selective, whole-layer
    checkpoint_offload.py  activation checkpoints on the host: each layer's input offloaded, the layer re-run
    chunked_layer.py       a whole layer's run and re-run with its token-wise parts in mini-sequences
    token_split.py         which rows are kept and which dropped/re-run (local and tp-gathered tensors)
    forward_state.py       a forward's autocast, entered again by every re-run
    arena.py               framework buffers from a planned arena (Arena, PlannedArena, ArenaHandle)
"""
