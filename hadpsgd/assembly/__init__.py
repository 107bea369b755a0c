"""The assembly of a run: build the parts from the configuration, resume policy, provenance.

The one room between the flags (:mod:`hadpsgd.config`) and the training loop
(:mod:`hadpsgd.train`): it reads a ``RunConfig``, checks every input before anything is
written, builds data, model, optimizer, algorithm and loop, applies ``--resume``, and records
what ran where in the run directory. ``hadpsgd.train`` takes the built parts and knows no
flags.
"""

from hadpsgd.assembly.build import algorithm_kwargs, build_algorithm, build_trainer
from hadpsgd.assembly.resume import check_layout, resume
from hadpsgd.assembly.resume_config import resumed_config

__all__ = ["algorithm_kwargs", "build_algorithm", "build_trainer", "check_layout", "resume",
           "resumed_config"]
