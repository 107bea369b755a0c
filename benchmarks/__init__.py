"""Benchmarks of hadpsgd, one subpackage per job.

- :mod:`benchmarks.comm`: the nccl-tests-style microbenchmark of ``hadpsgd.comm``
  (``python -m benchmarks.comm``);
- :mod:`benchmarks.training`: training throughput against DDP, straggler tolerance, BMUF
  (``python -m benchmarks.train_throughput``, ``.straggler``, ``.bmuf``);
- :mod:`benchmarks._common`: the launcher helper and the timing harness every job uses.

Each measures hadpsgd against a baseline measured in the same run. The sweeps, the cost model
and the paper studies are the lab (:mod:`lab`), which imports this package, never the reverse.

The top-level modules ``train_throughput``, ``straggler`` and ``bmuf`` are entry points only:
each runs the ``main`` of its subpackage. Nothing here imports :mod:`lab`: the sweeps, plots,
projection and studies are ``python -m lab.sweep``, ``lab.plots``, ``lab.project`` and
``lab.studies``.
"""
