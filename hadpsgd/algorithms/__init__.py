"""Training algorithms (contract): one base class, a name registry, and the algorithms."""

from hadpsgd.algorithms.base import Algorithm, build, get, names, register
from hadpsgd.algorithms.ssgd import SSGD

__all__ = ["SSGD", "Algorithm", "build", "get", "names", "register"]
