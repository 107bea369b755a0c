"""Worker: rank 0 never joins the allreduce; every other rank must end within the deadline
with an error on stderr that names rank 0, and the job must abort."""

import os
import time

import torch

from hadpsgd import comm

topo = comm.init(preload=False)  # no optimizer steps here
if topo.rank == 0:
    time.sleep(60)  # alive but never calls the collective: only the deadline can end the job
    os._exit(0)
print(f"ENTER rank {topo.rank} {time.time():.3f}", flush=True)
topo.allreduce_(torch.ones(10), path=os.environ.get("DEADLINE_PATH", "auto"))
print("NO TIMEOUT", flush=True)
