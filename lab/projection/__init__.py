"""The speedup projection, ``python -m lab.project``, and what it rests on.

- :mod:`.costmodel`: the alpha-beta cost model of the algorithms' communication and its fit;
- :mod:`.calibrate`: this machine's links from ``benchmarks.comm`` JSON, its compute step timed;
- :mod:`.project`: the paper's cluster, the local one, the tables and the JSON record.
"""
