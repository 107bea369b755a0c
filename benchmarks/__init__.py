"""Benchmarks of hadpsgd, one subpackage per job.

- :mod:`benchmarks.comm`: the nccl-tests-style microbenchmark of ``hadpsgd.comm``
  (``python -m benchmarks.comm``);
- :mod:`benchmarks.training`: training throughput against DDP, straggler tolerance, BMUF
  (``python -m benchmarks.train_throughput``, ``.straggler``, ``.bmuf``);
- :mod:`benchmarks.sweep`: grids of real training runs, their results and plots
  (``python -m benchmarks.sweep``, ``python -m benchmarks.plots``);
- :mod:`benchmarks.projection`: the alpha-beta cost model, its calibration on this machine and
  the speedup projection (``python -m benchmarks.project``);
- :mod:`benchmarks.studies`: the two paper studies (shell scripts and their tables);
- :mod:`benchmarks._common`: the launcher helper and the timing harness every job uses.

The top-level modules ``train_throughput``, ``straggler``, ``bmuf``, ``plots`` and ``project``
are entry points only: each runs the ``main`` of its subpackage.
"""
