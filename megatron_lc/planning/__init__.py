"""Offline memory planning (Memo's bi-level plan and the static allocator that replays it): trace capture, the
planners and solvers, plots, the caching-allocator simulator, the CUDA replay; ``runtime.py`` applies
``memory.plan`` at setup. Modules are imported by path (``planning.planner``, ...): OR-Tools and matplotlib load only
where they run."""
