"""The lab: sweeps, the cost model and the paper studies, beside the product and its benchmarks.

Nothing here measures hadpsgd against a baseline in the same run (that is :mod:`benchmarks`);
the lab runs grids of trainings, models and projects their cost, and reproduces the papers'
tables. It sits on top of the rest: it may import :mod:`hadpsgd` and :mod:`benchmarks`, and
neither of them imports it.
It is not part of the hadpsgd wheel.

- :mod:`lab.sweep`: grids of real training runs, their results and plots
  (``python -m lab.sweep``, ``python -m lab.plots``);
- :mod:`lab.projection`: the alpha-beta cost model, its calibration on this machine and the
  speedup projection (``python -m lab.project``);
- :mod:`lab.studies`: the two paper studies (``lab/studies/study_a.sh``, ``study_b.sh``) and
  their tables (``python -m lab.studies.tables``).

The top-level modules ``plots`` and ``project`` are entry points only: each runs the ``main``
of its subpackage.
"""
