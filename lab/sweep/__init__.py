"""Sweeps of real training runs, ``python -m lab.sweep``, and their plots.

- :mod:`.cli`: the command line and the loop over the cells (resume, summary);
- :mod:`.runner`: one cell under mpirun, Slurm scripts, collecting finished Slurm jobs;
- :mod:`.grid`: the grid, its cells, their ids and command lines;
- :mod:`.results`: the results table (``results.jsonl`` and ``.csv``);
- :mod:`.plots`: PNG plots of a sweep directory (``python -m lab.plots``).
"""
