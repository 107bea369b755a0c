"""speechocean762: continuous read English from 250 non-native speakers, for hadpsgd.

``python examples/speechocean/build.py CORPUS OUTDIR`` writes ``train.h5``, ``dev.h5`` and
``test.h5`` (120 phone-state classes from pocketsphinx's forced alignment), their Kaldi
``text`` files, and ``HCLG.fst`` + ``words.txt`` for ``python -m hadpsgd.decode --graph``
(examples/speechocean/README.md). The modules:

- :mod:`examples.speechocean.corpus` — the Kaldi data directories, the split by speaker, the
  lexicon;
- :mod:`examples.speechocean.phones` — the targets: 40 phones x 3 states;
- :mod:`examples.speechocean.align` — pocketsphinx's forced alignment, cached, on two
  processes;
- :mod:`examples.speechocean.check_align` — alignments against the audio's energy;
- :mod:`examples.speechocean.features` — fbank + deltas, per-speaker CMVN, the HDF5 sets;
- :mod:`examples.speechocean.lm` — a word bigram and its grammar FST;
- :mod:`examples.speechocean.graph` — H, L, LG and HCLG with kaldifst;
- :mod:`examples.speechocean.build` — the command.
"""
