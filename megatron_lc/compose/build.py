"""``build_model``: the model for this rank from its spec, and its context. Pure: it constructs and initialises
the model on the host and returns it with its ``ModelContext`` -- nothing is attached to the model, nothing is
communicated, nothing lands on a device. Moving to the device, the technique runtimes' calibration and the memory
plan are later, explicit steps of ``training/setup.py``."""
from __future__ import annotations

from typing import Callable, Optional

from ..config import Config, Execution, Layout
from ..model.init import init_model
from ..model.transformer import GPTModel
from ..parallel.topology import Topology
from .context import ModelContext, model_context
from .spec import ModelParts, ModelSpec, model_spec


def build_model(cfg: Config, layout: Layout, topo: Topology,
                adjust_spec: Optional[Callable[[ModelSpec], ModelSpec]] = None,
                execution: Optional[Execution] = None, init: bool = True) -> tuple[GPTModel, ModelContext]:
    """The model for this rank, initialised layout-independently from ``cfg.train.seed`` (on the host), and its
    context. ``adjust_spec``: changes the config's spec before construction (a comparison row or a test double,
    e.g. ``lambda s: dataclasses.replace(s, executor=LayerCheckpointExecutor)``); ``execution``: the run's (its
    attention kernels; None: those of the tensors' device); ``init`` False: left as constructed (on the meta
    device: ``model/init.materialize`` initialises it once FSDP2 has sharded it)."""
    ctx = model_context(cfg, layout)
    spec = model_spec(cfg, layout, ctx)
    if adjust_spec is not None:
        spec = adjust_spec(spec)
    model = GPTModel(cfg.model, ModelParts(cfg, layout, topo, spec, ctx, execution))
    if init:
        init_model(model, cfg.train.seed, topo)
    return model, ctx
