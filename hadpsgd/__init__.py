"""hadpsgd: hierarchical decentralized training (SSGD, ADPSGD / H-ADPSGD, BMUF-Adam) for PyTorch.

The public API (docs/api.md): ``hadpsgd.init`` (the learners' topology from MPI) and
``hadpsgd.Distributed`` (a model and optimizer under an algorithm, called once per step), with
the samplers, the step's verdict and the errors they raise. They load on first use (PEP 562),
so that ``import hadpsgd`` stays light for the tools that need no torch (``hadpsgd.decode``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hadpsgd.api import (
        CommTimeoutError,
        Distributed,
        OptionError,
        PoolSampler,
        Sampler,
        ShardSampler,
        StepResult,
        Topology,
        TopologyError,
        init,
    )

_API = ("CommTimeoutError", "Distributed", "OptionError", "PoolSampler", "Sampler",
        "ShardSampler", "StepResult", "Topology", "TopologyError", "init")


def __getattr__(name: str) -> Any:
    if name in _API:
        from hadpsgd import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["CommTimeoutError", "Distributed", "OptionError", "PoolSampler", "Sampler",
           "ShardSampler", "StepResult", "Topology", "TopologyError", "__version__", "init"]
