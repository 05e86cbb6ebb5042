"""Token-wise recompute and Memo offload (the Memo paper, section 4.1): ``executor.py`` runs a layer split into kept
and recomputed tokens (``steps.py``), its skeletal tensors placed in rounding buffers (``slots.py``) that go to
the host and back (``runtime.py``: ``MemoRuntime``, the technique runtime); ``alpha.py`` is the section 4.1 LP and
``profiler.py`` profiles a layer, solves alpha and sizes the buffers before training."""
from .alpha import AlphaInputs, AlphaResult, check_fixed_alpha, solve_alpha
from .executor import MemoBlockExecutor, MemoExecutor
from .profiler import calibrate_memo
from .runtime import MemoRuntime

__all__ = ["AlphaInputs", "AlphaResult", "MemoBlockExecutor", "MemoExecutor", "MemoRuntime",
           "calibrate_memo", "check_fixed_alpha", "solve_alpha"]
