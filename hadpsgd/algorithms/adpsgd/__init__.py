"""ADPSGD and H-ADPSGD: synchronous inside a super-learner, asynchronous gossip between.

``algorithm`` (the learner's steps, the gossip thread's deltas, bounded staleness, the byte
counts), ``options`` (its flags and wire facts) and ``replicas`` (the evaluation model: the
replicas' average, or each replica). The gossip itself is :mod:`hadpsgd.algorithms.gossip`
(CHOCO's compressed differences: :mod:`hadpsgd.algorithms.choco`).
"""

from hadpsgd.algorithms.adpsgd.algorithm import ADPSGD
from hadpsgd.algorithms.adpsgd.options import (
    CHOCO_HELD_UP_TO,
    CHOCO_WIRES,
    ADPSGDOptions,
    average_wire,
)

__all__ = ["ADPSGD", "CHOCO_HELD_UP_TO", "CHOCO_WIRES", "ADPSGDOptions", "average_wire"]
