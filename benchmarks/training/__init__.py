"""Training benchmarks: each a driver that launches its worker on local MPI ranks.

- :mod:`.throughput` (``python benchmarks/train_throughput.py``): frames/s of hadpsgd SSGD
  against torch DDP and a plain loop, worker :mod:`.throughput_worker`;
- :mod:`.straggler` (``python benchmarks/straggler.py``): ADPSGD against SSGD with one slow
  rank, run through ``python -m hadpsgd.run`` (no worker of its own);
- :mod:`.bmuf` (``python benchmarks/bmuf.py``): BMUF at several sync periods against
  local-only and SSGD, worker :mod:`.bmuf_worker`.

The workers time their steps with :mod:`benchmarks._common.timing`.
"""
