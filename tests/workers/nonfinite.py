"""Worker: a NaN gradient on one learner is skipped by every learner that shares it.

Usage: nonfinite.py ALGO. The checks are ``tests/nonfinite_suite.py``'s; prints ``OK rank r``
or the failures.
"""

import sys

from hadpsgd import comm
from tests.nonfinite_suite import check_nonfinite

topo = comm.init()
failures = check_nonfinite(topo, sys.argv[1])
if failures:
    print(f"FAIL rank {topo.rank}: {failures}", flush=True)
    sys.exit(1)
print(f"OK rank {topo.rank}", flush=True)
