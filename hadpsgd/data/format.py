"""The HDF5 feature format (docs/design.md, the feature format): one file per split.

=============  ============================  ==================================================
dataset        dtype / shape                 meaning
=============  ============================  ==================================================
``feats``      float32 ``[T, D]``, chunked   all utterances' frames, concatenated
``labels``     int32 ``[T]``                 frame targets in ``[0, num_classes)``
``offsets``    int64 ``[U+1]``               utterance u is ``feats[offsets[u]:offsets[u+1]]``
``utt_ids``    variable-length str ``[U]``   utterance names
``norm/mean``  float32 ``[D]`` (optional)    subtracted from every frame on read
``norm/std``   float32 ``[D]`` (optional)    every frame is divided by it on read
=============  ============================  ==================================================

File attributes: ``num_classes``, ``feat_dim``, ``format_version`` (= :data:`FORMAT_VERSION`).

This module is the stable entry point; the implementation lives in
:mod:`hadpsgd.data.writer` and :mod:`hadpsgd.data.reader`.
"""

from hadpsgd.data._schema import FORMAT_VERSION, FeatureFileError
from hadpsgd.data.reader import FeatureFile
from hadpsgd.data.writer import FeatureWriter, write_features

__all__ = ["FORMAT_VERSION", "FeatureFile", "FeatureFileError", "FeatureWriter", "write_features"]
