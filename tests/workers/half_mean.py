"""Worker: ``tests/half_mean_check.py`` under mpirun (``half_mean.py SCOPE``)."""

import sys

from hadpsgd import comm
from tests.half_mean_check import check_half_mean

topo = comm.init(preload=False)  # no optimizer steps here
failed = check_half_mean(topo, sys.argv[1])
topo.close()  # (a warm world runs this worker again in the same process: free what it made)
if failed:
    print(failed, flush=True)
    sys.exit(1)
print(f"OK rank {topo.rank}", flush=True)
