"""Worker: BMUF's reference suite (``tests/bmuf_suite.py``) under mpirun.

Usage: ``bmuf_ref.py SUITE OUT_DIR GROUPS`` (GROUPS e.g. ``1,2``: each rank is fed the
concatenated batches of that many consecutive virtual learners, so a flat run can be fed the
super-batches of a hierarchical one). Rank 0 writes ``OUT_DIR/<name>-g<G>.npz`` per
configuration and group size.
"""

import sys
from pathlib import Path

from hadpsgd import comm
from tests.bmuf_suite import run_suite

topo = comm.init()
run_suite(topo, sys.argv[1], Path(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")])
topo.barrier()
topo.close()
print(f"OK rank {topo.rank} {topo.describe()}", flush=True)
