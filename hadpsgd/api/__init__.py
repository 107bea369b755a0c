"""The public API: your model, your optimizer, your loop, under one of hadpsgd's algorithms.

``topo = hadpsgd.init()``, then ``dist = hadpsgd.Distributed(model, optimizer, algo="bmuf",
topology=topo, sync_period=8)``, then ``dist.step(loss)`` after each backward; see
docs/api.md.
"""

from hadpsgd.algorithms import StepResult
from hadpsgd.api.distributed import Distributed
from hadpsgd.api.frames import FrameSampler
from hadpsgd.api.options import SHARED_OPTIONS, OptionError
from hadpsgd.api.samplers import PoolSampler, Sampler, ShardSampler
from hadpsgd.api.setup import init
from hadpsgd.api.state import STATE_FORMAT
from hadpsgd.comm import CommTimeoutError, Topology, TopologyError

__all__ = ["SHARED_OPTIONS", "STATE_FORMAT", "CommTimeoutError", "Distributed", "FrameSampler",
           "OptionError", "PoolSampler", "Sampler", "ShardSampler", "StepResult", "Topology",
           "TopologyError", "init"]
