"""Worker: rank 1 starts with another ``HADPSGD_INTRA_BACKEND`` (gloo) than the others (mpi).

Every rank must refuse alike at ``comm.init`` (the settings are agreed before any rank acts
on its own), printing ``REFUSED rank r: <message>``; a rank that got a topology prints
``NO REFUSAL``. With ``HADPSGD_SHARE_GPU`` set (every rank alike) the settings agree, and
every rank refuses the shared-GPU test mode on CPU instead.
"""

import os

from hadpsgd import comm

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
if os.environ.get("HADPSGD_SHARE_GPU"):
    pass  # the shared-GPU test mode on CPU: every rank refuses alike (issue 59)
else:
    os.environ["HADPSGD_INTRA_BACKEND"] = "gloo" if rank == 1 else "mpi"
try:
    topo = comm.init(device="cpu", preload=False)
except comm.TopologyError as err:
    print(f"REFUSED rank {rank}: {err}", flush=True)
else:
    print("NO REFUSAL", flush=True)
    topo.close()
