"""Automatic layout choice: enumerate tp x cp x cp flavour x ulysses x memory features x chunk sizes, estimate each,
keep the ones that fit device and host memory, rank them by step time.

    best = search_layouts(cfg, load_hardware("h100"), world_size=8)[:5]
    best[0].overrides   # {"parallel.tensor_model_parallel_size": 2, ..., "memory.offload_fraction": 0.42}

What is searched (model, data and batch sizes stay as configured):

* tp: divisors of the world size up to a node's GPUs that divide heads, kv heads, FFN and the padded vocab;
  sequence parallelism on whenever tp > 1 (it only saves memory); cp = world / (tp x dp), with dp as the global
  batch allows;
* cp flavour: ring (p2p), Ulysses (a2a), hybrid (a2a+p2p, every ulysses size between), FPDT (fpdt, chunk sizes
  seq / u for u = 1, 2, 4, ... with chunks of at least 8K tokens, offload on and off);
* memory: recompute none / full, Memo offload with α from the LP (``auto``) or α in {0, 1/8, 1/4, 1/2, 1},
  activation checkpoints on the host (``activation_offload: checkpoints``) with every layer's input or every k-th
  one's (``memory.checkpoint_every`` in ``EVERY``: the smallest k whose host bytes fit is the fastest), MsT on /
  off; recompute full, Memo with α in {auto, 0} and the checkpoints mode also with their re-run in mini-sequences
  of ``LAYER_CHUNK`` local rows (``memory.layer_chunk_size``; skipped where a chunk holds every re-run row: the same
  run as without); with FPDT the checkpoints mode, chunked (FPDT's block as the chunked layer's attention) or not;
* model states: ZeRO-1 (``use_distributed_optimizer``) whenever dp x cp > 1, FSDP2 (``use_torch_fsdp2``), FSDP2
  with ``fsdp_cpu_offload``;
* an MoE model's expert parallelism: every ``parallel.expert_model_parallel_size`` dividing dp x cp and the
  experts (the estimate assumes the busiest expert rank's load ``config.moe.EXPERT_LOAD``).

Skipped: anything ``config.resolve_layout`` rejects; recompute / Memo with FPDT unless ``allow_fpdt_recompute`` (the
framework runs them in Memo's block mode, but no calibration case covers the estimate of it yet); selective recompute
(saves nothing with flash-style kernels, runs attention twice). With ``memory.offload_fraction: auto`` the α written
to the config is the estimator's LP solution; the framework re-solves it from its own profiler at start-up
(memory/memo/profiler.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..config import Config, ConfigError
from . import Estimate, estimate
from .hardware import HardwareProfile
from .inventory import layer_chunk_share

ALPHAS = ("auto", 0.0, 0.125, 0.25, 0.5, 1.0)
MIN_FPDT_CHUNK = 8192
LAYER_CHUNK = 16384  # memory.layer_chunk_size tried (local rows per mini-sequence of a layer's re-run)
CHUNKED_ALPHAS = ("auto", 0.0)  # the Memo α tried with LAYER_CHUNK
EVERY = (1, 2, 4, 8)  # memory.checkpoint_every tried with the host checkpoints


@dataclass
class Candidate:
    overrides: dict  # "section.key" -> value, what --write puts into the config
    est: Estimate
    notes: list = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        return self.est.time.step_seconds

    def label(self) -> str:
        o = self.overrides
        cp_type = o["parallel.cp_comm_type"]
        cp = o["parallel.context_parallel_size"]
        parts = [f"tp{o['parallel.tensor_model_parallel_size']}", f"cp{cp}"]
        if o.get("parallel.expert_model_parallel_size", 1) > 1:
            parts.append(f"ep{o['parallel.expert_model_parallel_size']}")
        if cp > 1 or cp_type == "fpdt":
            parts.append({"p2p": "ring", "a2a": "ulysses", "a2a+p2p": f"ulysses{o['parallel.ulysses_size']}xring",
                          "fpdt": "fpdt"}[cp_type])
        if cp_type == "fpdt":
            parts.append(f"chunk{o['memory.fpdt_chunk_size'] // 1024}K" + ("" if o["memory.fpdt_offload"] else "-dev"))
        if o["memory.activation_offload"] == "checkpoints":
            k = o.get("memory.checkpoint_every", 1)
            parts.append("ckpt-offload" + (f"-every{k}" if k > 1 else ""))
        elif o["memory.activation_offload"] == "memo":
            a = self.est.memory.alpha
            parts.append(f"memo(a={a:.3g}{',auto' if o['memory.offload_fraction'] == 'auto' else ''})")
        elif o["memory.recompute_granularity"] != "none":
            parts.append(f"recompute-{o['memory.recompute_granularity']}")
        c = o.get("memory.layer_chunk_size")
        if c:
            parts.append(f"chunks{c // 1024}K" if c % 1024 == 0 else f"chunks{c}")
        if o["memory.mst"]:
            parts.append("mst")
        if o.get("parallel.use_torch_fsdp2"):
            parts.append("fsdp2" + ("-cpu-offload" if o.get("parallel.fsdp_cpu_offload") else ""))
        elif o.get("parallel.use_distributed_optimizer"):
            parts.append("zero1")
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    out, u = [], 1
    while u <= n:
        out.append(u)
        u *= 2
    return out


def layouts(cfg: Config, hw: HardwareProfile, world: int) -> Iterator[dict]:
    """Every parallel layout (as overrides) worth estimating for ``cfg`` on ``world`` ranks."""
    m, t, s = cfg.model, cfg.train, cfg.data.seq_length
    gbs = t.global_batch_size
    for tp in _divisors(world):
        if tp > hw.gpus_per_node or m.num_attention_heads % tp or m.num_query_groups % tp or m.ffn_hidden_size % tp \
                or m.padded_vocab_size % tp:
            continue
        for dp in _divisors(world // tp):
            if gbs is not None and gbs % (t.micro_batch_size * dp):
                continue
            cp = world // (tp * dp)
            flavours: list[tuple[str, int]] = [("p2p", 1)]
            if cp > 1:
                flavours += [("a2a", cp)] + [("a2a+p2p", u) for u in _divisors(cp) if 1 < u < cp]
            flavours.append(("fpdt", cp))
            for states in sharding_options(dp * cp):
                for experts in expert_options(cfg, dp * cp):
                    base = {"parallel.tensor_model_parallel_size": tp, "parallel.context_parallel_size": cp,
                            "parallel.sequence_parallel": tp > 1, **states, **experts}
                    yield from _flavoured(base, flavours, s)


def expert_options(cfg: Config, n: int) -> list[dict]:
    """An MoE model's expert parallelism over ``n`` = dp x cp ranks: every ep dividing both n and the experts
    (``parallel.expert_model_parallel_size``); a dense model: nothing to choose."""
    e = cfg.model.num_moe_experts
    if e is None:
        return [{}]
    return [{"parallel.expert_model_parallel_size": ep} for ep in _divisors(n) if e % ep == 0]


def sharding_options(n: int) -> list[dict]:
    """How the model states are kept over ``n`` = dp x cp ranks: ZeRO-1 (n > 1; plain AdamW when n = 1), FSDP2,
    FSDP2 with its states on the host."""
    plain = {"parallel.use_distributed_optimizer": n > 1, "parallel.use_torch_fsdp2": False,
             "parallel.fsdp_cpu_offload": False}
    fsdp = {"parallel.use_distributed_optimizer": False, "parallel.use_torch_fsdp2": True}
    return [plain, dict(fsdp, **{"parallel.fsdp_cpu_offload": False}),
            dict(fsdp, **{"parallel.fsdp_cpu_offload": True})]


def _flavoured(base: dict, flavours: list, s: int) -> Iterator[dict]:
    for kind, u in flavours:
        par = dict(base, **{"parallel.cp_comm_type": kind, "parallel.ulysses_size": u})
        if kind != "fpdt":
            yield dict(par, **{"memory.fpdt_chunk_size": None, "memory.fpdt_offload": True})
            continue
        for n in _pow2_upto(s // MIN_FPDT_CHUNK):
            if s % n:
                continue
            for off in (True, False):
                yield dict(par, **{"memory.fpdt_chunk_size": s // n, "memory.fpdt_offload": off})


def memory_options(fpdt: bool) -> Iterator[dict]:
    """The ``memory.*`` switches tried for one layout (``fpdt``: FPDT's block without token-wise recompute or Memo
    around it; the host checkpoints, chunked or not, take it)."""
    def opt(recompute: str, offload: str, alpha, mst: bool, chunk: Optional[int] = None, every: int = 1) -> dict:
        return {"memory.recompute_granularity": recompute, "memory.activation_offload": offload,
                "memory.offload_fraction": alpha, "memory.mst": mst, "memory.layer_chunk_size": chunk,
                "memory.checkpoint_every": every}

    for mst in (False, True):
        yield opt("none", "none", "auto", mst)
        for chunk in (None, LAYER_CHUNK):
            if not fpdt:  # FPDT + recompute / Memo (block mode) runs, but its estimate is not calibrated: opt-in
                yield opt("full", "none", "auto", mst, chunk)
                for a in (ALPHAS if chunk is None else CHUNKED_ALPHAS):
                    yield opt("none", "memo", a, mst, chunk)
            for every in EVERY:
                yield opt("none", "checkpoints", "auto", mst, chunk, every)


def apply_overrides(cfg: Config, overrides: dict) -> Config:
    """A copy of ``cfg`` with ``section.key`` values set (validated by the sections' own checks)."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    out.parallel.__post_init__()
    out.memory.__post_init__()
    return out


def search_layouts(cfg: Config, hw: HardwareProfile, world_size: int, top: Optional[int] = None,
                   include_unfit: bool = False, states: str = "framework", allow_fpdt_recompute: bool = False,
                   features: Optional[dict] = None) -> list[Candidate]:
    """Estimate every layout x memory option; the ones that fit (or all, with ``include_unfit``), fastest first.

    ``states``: model-state preset (``states.py``); ``allow_fpdt_recompute``: also try recompute/Memo with FPDT (a
    what-if: the framework refuses it today); ``features``: fixed ``memory.*`` values (e.g. ``{"memory.mst":
    False}``) that restrict the memory options searched."""
    out: list[Candidate] = []
    for par in layouts(cfg, hw, world_size):
        for memo in memory_options(par["parallel.cp_comm_type"] == "fpdt" and not allow_fpdt_recompute):
            if features and any(memo.get(k, v) != v for k, v in features.items()):
                continue
            ov = dict(par, **memo)
            try:
                trial = apply_overrides(cfg, ov)
                est = estimate(trial, hw, world_size, states=states)
            except ConfigError:
                continue
            if ov["memory.layer_chunk_size"] and layer_chunk_share(trial, est.dims, est.memory.alpha or 0.0) is None:
                continue  # a chunk holds every re-run row: the unchunked option, already estimated
            if est.status == "fits" or include_unfit:
                if ov["memory.offload_fraction"] == "auto" and est.memory.alpha is not None:
                    ov["memory.offload_fraction"] = round(est.memory.alpha, 4)
                    ov["memory.offload_fraction_source"] = "auto"
                out.append(Candidate(ov, est))
    out.sort(key=lambda c: (c.est.status != "fits", c.step_seconds, c.est.memory.host_per_node, c.est.memory.peak))
    return out[:top] if top else out


def pick_best(cands: list[Candidate], tolerance: float = 0.005) -> Candidate:
    """Among the layouts within ``tolerance`` of the fastest step, the one with the most headroom: least host
    memory, then least device memory (a 0.3% faster layout is not worth filling the host to the last GiB)."""
    fits = [c for c in cands if c.est.status == "fits"] or cands
    fastest = min(c.step_seconds for c in fits)
    near = [c for c in fits if c.step_seconds <= fastest * (1 + tolerance)]
    return min(near, key=lambda c: (c.est.memory.host_per_node / c.est.memory.host_capacity
                                    + c.est.memory.peak / c.est.memory.capacity, c.step_seconds))


def config_overrides(c: Candidate) -> dict:
    """The overrides to write into a config: the parallel keys, the memory switches (``memory.layer_chunk_size``
    None for a candidate without mini-sequences, so ``--write`` clears an old value), FPDT's keys only for FPDT
    (drops the bookkeeping keys)."""
    fpdt = c.overrides["parallel.cp_comm_type"] == "fpdt"
    return {k: v for k, v in c.overrides.items()
            if not k.endswith("_source") and (fpdt or not k.startswith("memory.fpdt_"))}
