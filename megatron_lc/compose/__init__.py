"""The composition root: the one place that knows every technique and puts a model together from the config.
It sits above ``model/``, ``attention/``, ``memory/``, ``planning/`` and ``parallel/`` (none of them imports it)
and below ``training/``::

    context.py   ModelContext (one technique runtime per memory technique turned on), model_context, the
                 runtime protocol setup runs (TechniqueRuntime, Calibration)
    spec.py      ModelSpec (which class builds each part), model_spec, ModelParts (what model/ asks for)
    build.py     build_model: spec -> model + context, on the host, no side effects

Adding a memory technique: its config (``config/memory.py``, a refused pair in ``config/combinations.py`` where
one exists) and its name in its slot of ``config/techniques.py``, its spec entry (one entry in its slot's dict of
``spec.py``), its runtime (``model_context``), its estimator term (a file in ``estimate/terms/`` and one entry in
its slot's dict there); docs/ARCHITECTURE.md, "Adding a memory technique"."""
from .build import build_model
from .context import Calibration, ModelContext, TechniqueRuntime, model_context
from .spec import ModelParts, ModelSpec, model_spec

__all__ = ["Calibration", "ModelContext", "ModelParts", "ModelSpec", "TechniqueRuntime", "build_model",
           "model_context", "model_spec"]
