"""Worker: ``tests/bmuf_stream_suite.py``'s run under mpirun.

Usage: ``bmuf_stream.py OUT_DIR`` (see :func:`tests.bmuf_stream_suite.run_stream`).
"""

import sys
from pathlib import Path

from hadpsgd import comm
from tests.bmuf_stream_suite import run_stream

topo = comm.init()
run_stream(topo, Path(sys.argv[1]))
topo.close()
print(f"OK rank {topo.rank} {topo.describe()}", flush=True)
