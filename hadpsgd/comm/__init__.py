"""Communication layer (contract): topology discovery and collectives on flat tensors."""

from hadpsgd.comm.deadline import CommTimeoutError, timeout_from_env
from hadpsgd.comm.flat import FlatBuffer
from hadpsgd.comm.topology import Topology, TopologyError, init

__all__ = ["CommTimeoutError", "FlatBuffer", "Topology", "TopologyError", "init",
           "timeout_from_env"]
