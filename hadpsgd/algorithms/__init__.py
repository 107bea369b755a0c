"""Training algorithms (contract): one base class, a name registry, and the algorithms."""

from hadpsgd.algorithms.adpsgd import ADPSGD
from hadpsgd.algorithms.base import Algorithm, build, get, names, register
from hadpsgd.algorithms.bmuf import BMUF
from hadpsgd.algorithms.ssgd import SSGD

__all__ = ["ADPSGD", "BMUF", "SSGD", "Algorithm", "build", "get", "names", "register"]
