"""BMUF and BMUF-Adam: blockwise model-update filtering across super-learners.

``algorithm`` (the schedule, state and evaluation model), ``options`` (its flags),
``filter`` (the block filter, fragment by fragment: blocking, or one block late and re-based),
``exchange`` (an average's way across the nodes) and ``moments`` (the optimizer's moment
buffers at a sync).
"""

from hadpsgd.algorithms.bmuf.algorithm import BMUF
from hadpsgd.algorithms.bmuf.options import BMUFOptions

__all__ = ["BMUF", "BMUFOptions"]
