"""Training algorithms (contract): one base class, a name registry, and the algorithms."""

from hadpsgd.algorithms.adpsgd import ADPSGD, ADPSGDOptions
from hadpsgd.algorithms.base import Algorithm, StepResult
from hadpsgd.algorithms.bmuf import BMUF, BMUFOptions
from hadpsgd.algorithms.options import AlgoOptions
from hadpsgd.algorithms.registry import AlgoSpec, build, get, names, register, spec, specs
from hadpsgd.algorithms.ssgd import SSGD

__all__ = ["ADPSGD", "BMUF", "SSGD", "ADPSGDOptions", "AlgoOptions", "AlgoSpec", "Algorithm",
           "BMUFOptions", "StepResult", "build", "get", "names", "register", "spec", "specs"]
