"""Communication layer (contract): topology discovery and collectives on flat tensors.

``init()`` returns a :class:`Topology` with hierarchical ``allreduce_`` (intra-node backend
+ MPI between nodes), ``broadcast_``, the gossip pair ``exchange`` and their deadlines. The
algorithms, the loop and the API see it as a :class:`World` (:mod:`hadpsgd.comm.world`).
"""

from hadpsgd.comm.codec import WIRES, decode, encode, payload_bytes
from hadpsgd.comm.compressed import CompressedMean
from hadpsgd.comm.counter import SharedCounter
from hadpsgd.comm.deadline import (
    CommTimeoutError,
    PeerEndedError,
    Watchdog,
    before_abort,
    last_words,
    timeout_from_env,
)
from hadpsgd.comm.ending import meet_at_end
from hadpsgd.comm.flat import FlatBuffer, cudnn_weight_groups
from hadpsgd.comm.init import DEFAULT_BUCKET_MB, INTRA_BACKENDS, init
from hadpsgd.comm.mpi import library_version as mpi_library_version
from hadpsgd.comm.mpi import world_rank
from hadpsgd.comm.topology import Topology, TopologyError
from hadpsgd.comm.world import World

__all__ = ["DEFAULT_BUCKET_MB", "INTRA_BACKENDS", "WIRES", "CommTimeoutError", "CompressedMean",
           "FlatBuffer", "PeerEndedError", "SharedCounter", "Topology", "TopologyError", "Watchdog",
           "World", "before_abort", "cudnn_weight_groups", "decode", "encode", "init",
           "last_words", "meet_at_end", "mpi_library_version", "payload_bytes", "timeout_from_env",
           "world_rank"]
