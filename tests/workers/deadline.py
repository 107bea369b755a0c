"""Worker: rank 0 never joins the allreduce; every other rank must fail within the deadline
with an error that names rank 0."""

import os
import sys
import time

import torch

from hadpsgd import comm

topo = comm.init()
if topo.rank == 0:
    time.sleep(4 * topo.timeout + 10)  # alive but never calls the collective
    os._exit(0)
start = time.monotonic()
try:
    topo.allreduce_(torch.ones(10), path=os.environ.get("DEADLINE_PATH", "auto"))
except comm.CommTimeoutError as err:
    print(f"TIMEOUT rank {topo.rank} after {time.monotonic() - start:.1f}s "
          f"missing={err.missing}: {err}", flush=True)
    sys.stdout.flush()
    os._exit(3)  # MPI_Finalize could block on the unfinished collective
print("NO TIMEOUT", flush=True)
os._exit(0)
