"""The connected-digit set: real speech from espeak-ng, in hadpsgd's HDF5 feature format.

``python examples/digits/build.py OUTDIR`` writes ``OUTDIR/train.h5`` and
``OUTDIR/heldout.h5`` (docs/results.md and docs/decode.md measure on them). The modules:

- :mod:`examples.digits.voices` — espeak-ng: the synthetic speakers and their words;
- :mod:`examples.digits.audio` — resampling, a word's voiced span, an utterance of words
  with pauses, perturbation and noise;
- :mod:`examples.digits.features` — log-mel + deltas (kaldi-native-fbank), per-speaker
  CMVN, frame labels;
- :mod:`examples.digits.build` — the command.
"""
