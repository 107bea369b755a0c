"""Data: the HDF5 feature format, chunk sampler and loader, synthetic generator.

The Kaldi importer (:mod:`hadpsgd.data.kaldi`) is not imported here: kaldiio is optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hadpsgd.data._schema import FORMAT_VERSION, FeatureFileError
from hadpsgd.data.loader import ChunkDataset, make_loader
from hadpsgd.data.priors import (
    PRIORS_FILE,
    Priors,
    PriorsError,
    load_priors,
    priors_of,
    save_priors,
)
from hadpsgd.data.reader import FeatureFile
from hadpsgd.data.sampler import ChunkBatchSampler, PooledBatchSampler, chunk_starts
from hadpsgd.data.writer import FeatureWriter, mark_silence, write_features

if TYPE_CHECKING:
    from hadpsgd.data.synth import SynthSpec, default_dataset, generate

# The generator's names load on first use (PEP 562): importing hadpsgd.data.synth here would
# make ``python -m hadpsgd.data.synth`` warn that the module was imported before running.
_SYNTH = ("SynthSpec", "default_dataset", "generate")


def __getattr__(name: str) -> Any:
    if name in _SYNTH:
        from hadpsgd.data import synth

        return getattr(synth, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FORMAT_VERSION", "PRIORS_FILE", "ChunkBatchSampler", "ChunkDataset", "FeatureFile",
           "FeatureFileError", "FeatureWriter", "PooledBatchSampler", "Priors", "PriorsError",
           "SynthSpec", "chunk_starts", "default_dataset", "generate", "load_priors",
           "make_loader", "mark_silence", "priors_of", "save_priors", "write_features"]
