"""Data: the HDF5 feature format, chunk sampler and loader, synthetic generator.

The Kaldi importer (:mod:`hadpsgd.data.kaldi`) is not imported here: kaldiio is optional.
"""

from hadpsgd.data.format import (
    FORMAT_VERSION,
    FeatureFile,
    FeatureFileError,
    FeatureWriter,
    write_features,
)
from hadpsgd.data.loader import ChunkDataset, make_loader
from hadpsgd.data.sampler import ChunkBatchSampler, chunk_starts
from hadpsgd.data.synth import SynthSpec, default_dataset, generate

__all__ = ["FORMAT_VERSION", "ChunkBatchSampler", "ChunkDataset", "FeatureFile",
           "FeatureFileError", "FeatureWriter", "SynthSpec", "chunk_starts", "default_dataset",
           "generate", "make_loader", "write_features"]
