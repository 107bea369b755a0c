"""The communication microbenchmark, ``python -m benchmarks.comm`` (nccl-tests style).

- :mod:`.cli`: the command line and the launch (the driver never imports MPI);
- :mod:`.report`: sizes, bandwidths, the table and the summary (shared by driver and ranks);
- :mod:`.worker`: a rank's side: set-up, the run and the JSON record;
- :mod:`.measure`: the sweep over ops and sizes, timed on every rank alike;
- :mod:`.cases`: the measured operations, hadpsgd's and the raw mpi4py / gloo baselines.
"""
