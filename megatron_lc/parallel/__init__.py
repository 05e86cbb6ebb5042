from .topology import Axis, Topology

__all__ = ["Axis", "Topology"]
