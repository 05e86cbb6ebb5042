"""The rank grid and its process groups: one explicit object, passed as an argument.

Ranks are laid out as ``arange(world).view(dp, ring, ulysses, tp)`` -- tp innermost (fastest links), then the
Ulysses sub-axis of cp, then the ring sub-axis of cp, then dp. Example, 8 ranks, tp=2, cp=4 = ring 2 x ulysses 2,
dp=1::

    rank:      0  1  2  3  4  5  6  7
    tp rank:   0  1  0  1  0  1  0  1      tp groups:      [0,1] [2,3] [4,5] [6,7]
    ulysses:   0  0  1  1  0  0  1  1      ulysses groups: [0,2] [1,3] [4,6] [5,7]
    ring:      0  0  0  0  1  1  1  1      ring groups:    [0,4] [1,5] [2,6] [3,7]
    cp rank:   0  0  1  1  2  2  3  3      cp groups:      [0,2,4,6] [1,3,5,7]   (cp rank = ring*ulysses_size + ulysses)
                                           dp x cp groups: [0,2,4,6] [1,3,5,7]   (gradient all-reduce)

Expert parallelism cuts each dp x cp group into expert groups of ``ep`` consecutive ranks (in dp x cp order); the
ranks at the same place of each expert group hold the same experts and form the expert-data group (gradient
all-reduce of the experts). Example, 8 ranks, tp=2, cp=2, dp=2, ep=2 (dp x cp groups ``[0,2,4,6]`` ``[1,3,5,7]``)::

    ep groups:  [0,2] [4,6] [1,3] [5,7]      ep rank = dp x cp rank % ep
    edp groups: [0,4] [2,6] [1,5] [3,7]      (the experts' replicas: their gradients are summed here)

Every axis of size 1 has ``group is None`` semantics handled by the collectives (no communication).
"""
from __future__ import annotations

import datetime
import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .comm_stats import CommStats


class Axis(str, enum.Enum):
    DP = "dp"
    CP = "cp"
    RING = "ring"
    ULYSSES = "ulysses"
    TP = "tp"
    DP_CP = "dp_cp"
    EP = "ep"  # expert groups: consecutive runs of ep ranks of a dp x cp group
    EDP = "edp"  # the ranks holding the same experts: dp x cp / ep of them


@dataclass
class Topology:
    """Degrees and this rank's coordinates; ``groups`` hold the torch process groups this rank belongs to."""

    world_size: int = 1
    rank: int = 0
    tp: int = 1
    cp: int = 1
    ulysses: int = 1
    dp: int = 1
    ep: int = 1
    groups: dict = field(default_factory=dict, repr=False)
    group_ranks: dict = field(default_factory=dict, repr=False)
    comm: CommStats = field(default_factory=CommStats, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tp * self.cp * self.dp != self.world_size:
            raise ValueError(f"dp ({self.dp}) * cp ({self.cp}) * tp ({self.tp}) != world size ({self.world_size})")
        if self.cp % self.ulysses != 0:
            raise ValueError(f"ulysses ({self.ulysses}) must divide cp ({self.cp})")
        rest, t = divmod(self.rank, self.tp)
        rest, u = divmod(rest, self.ulysses)
        d, r = divmod(rest, self.ring)
        self.dp_rank, self.ring_rank, self.ulysses_rank, self.tp_rank = d, r, u, t
        self.cp_rank = r * self.ulysses + u
        if (self.dp * self.cp) % self.ep != 0:
            raise ValueError(f"ep ({self.ep}) must divide dp ({self.dp}) x cp ({self.cp})")

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The rank grid's shape (dp, ring, ulysses, tp); rank = ((d * ring + r) * ulysses + u) * tp + t."""
        return (self.dp, self.ring, self.ulysses, self.tp)

    def grid(self) -> torch.Tensor:
        """Rank grid of shape (dp, ring, ulysses, tp), as a tensor (a device mesh's)."""
        return torch.arange(self.world_size).view(*self.shape)

    def axis_groups(self, axis: Axis) -> list[list[int]]:
        """All rank lists of ``axis`` (every rank of the world is in exactly one list), in Python numbers: no tensor
        is made (a rehearsal asks under fake tensors, which have no values)."""
        if axis in (Axis.EP, Axis.EDP):  # cuts of each dp x cp group: runs of ep ranks, or every ep-th rank
            ep = self.ep
            return [g[i * ep:(i + 1) * ep] if axis is Axis.EP else g[i::ep]
                    for g in self.axis_groups(Axis.DP_CP) for i in range(len(g) // ep if axis is Axis.EP else ep)]
        dims = {Axis.DP: (0,), Axis.RING: (1,), Axis.ULYSSES: (2,), Axis.TP: (3,), Axis.CP: (1, 2),
                Axis.DP_CP: (0, 1, 2)}[axis]
        keep = [i for i in range(4) if i not in dims]
        shape = self.shape

        def rank(coords: dict) -> int:
            return ((coords[0] * shape[1] + coords[1]) * shape[2] + coords[2]) * shape[3] + coords[3]

        return [[rank({**dict(zip(keep, k)), **dict(zip(dims, a))})
                 for a in itertools.product(*(range(shape[i]) for i in dims))]
                for k in itertools.product(*(range(shape[i]) for i in keep))]

    def size(self, axis: Axis) -> int:
        return {Axis.DP: self.dp, Axis.CP: self.cp, Axis.RING: self.ring, Axis.ULYSSES: self.ulysses,
                Axis.TP: self.tp, Axis.DP_CP: self.dp * self.cp, Axis.EP: self.ep,
                Axis.EDP: self.dp * self.cp // self.ep}[axis]

    def axis_rank(self, axis: Axis) -> int:
        return {Axis.DP: self.dp_rank, Axis.CP: self.cp_rank, Axis.RING: self.ring_rank,
                Axis.ULYSSES: self.ulysses_rank, Axis.TP: self.tp_rank,
                Axis.DP_CP: self.dp_rank * self.cp + self.cp_rank,
                Axis.EP: (self.dp_rank * self.cp + self.cp_rank) % self.ep,
                Axis.EDP: (self.dp_rank * self.cp + self.cp_rank) // self.ep}[axis]

    def group(self, axis: Axis) -> Optional[dist.ProcessGroup]:
        """Process group of ``axis`` containing this rank; None when the axis has size 1 (nothing to talk to)."""
        if self.size(axis) == 1:
            return None
        if axis is Axis.EDP and self.ep == 1:  # without expert parallelism the experts' replicas are dp x cp
            axis = Axis.DP_CP
        if axis not in self.groups:
            raise RuntimeError("process groups were not built; call Topology.build(...) under torch.distributed")
        return self.groups[axis]

    def ranks(self, axis: Axis) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in axis-rank order."""
        for ranks in self.axis_groups(axis):
            if self.rank in ranks:
                return ranks
        raise AssertionError("rank not in grid")

    @classmethod
    def build(cls, tp: int = 1, cp: int = 1, ulysses: int = 1, world_size: Optional[int] = None,
              rank: Optional[int] = None, timeout: Optional[datetime.timedelta] = None, ep: int = 1) -> "Topology":
        """Create the topology of the running job and its process groups (all ranks must call this).

        ``timeout``: of every axis group's collectives (``new_group`` does not inherit the world group's timeout;
        torch's default is 30 min for gloo)."""
        initialized = dist.is_available() and dist.is_initialized()
        world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if world_size % (tp * cp) != 0:
            raise ValueError(f"world size ({world_size}) must be divisible by tp ({tp}) x cp ({cp})")
        topo = cls(world_size=world_size, rank=rank, tp=tp, cp=cp, ulysses=ulysses, dp=world_size // (tp * cp), ep=ep)
        if initialized and world_size > 1:
            for axis in Axis:
                if topo.size(axis) == 1 or (axis is Axis.EDP and ep == 1):  # (EDP is then dp x cp's group)
                    continue
                for ranks in topo.axis_groups(axis):  # every rank creates every group, same order
                    g = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        topo.groups[axis] = g
                        topo.group_ranks[axis] = ranks
        return topo

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp}, cp {self.cp_rank}/{self.cp} "
                f"(ring {self.ring_rank}/{self.ring}, ulysses {self.ulysses_rank}/{self.ulysses}), "
                f"tp {self.tp_rank}/{self.tp}" + (f", ep {self.axis_rank(Axis.EP)}/{self.ep}" if self.ep > 1 else ""))
