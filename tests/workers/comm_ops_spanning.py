"""Worker: the comm_ops checks with each emulated node spanning two "hosts".

Odd ranks report another host name than even ones (both names reach this machine), as the
learners of a super-learner larger than a host would: the torch.distributed intra-node group
(gloo here, NCCL on GPUs) must then meet through a TCP store whose address goes over MPI,
not a FileStore in one host's temp directory.
"""

import os
import runpy
import sys

from mpi4py import MPI

import hadpsgd.comm.backends as backends

rank = MPI.COMM_WORLD.Get_rank()
real_host_name = backends.host_name
backends.host_name = lambda: "127.0.0.1" if rank % 2 == 0 else "localhost"
try:
    sys.argv = [os.path.join(os.path.dirname(__file__), "comm_ops.py")]
    done = runpy.run_path(sys.argv[0], run_name="__main__")
finally:  # a warm world's process runs other commands after this one (tests/_commands.py)
    backends.host_name = real_host_name
print(f"rendezvous rank {rank}: {done['topo'].reducer.intra.rendezvous}", flush=True)
