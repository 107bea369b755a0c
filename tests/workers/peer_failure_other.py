"""Worker (under ``mpirun --with-ft ulfm``, 3 ranks): ``MPI_ERR_OTHER`` is taken for a peer's
failure once this process knows of a failed process in the world, and not before.

Open MPI's non-blocking collectives may end a schedule that met a failed peer with
``MPI_ERR_OTHER`` (the elastic soak: an ``Ibarrier`` after a checkpoint); before, that was
taken for the learner's own error and ended the job with exit 1.
"""

import os
import signal

from hadpsgd.comm import ulfm
from hadpsgd.comm.mpi import mpi

MPI = mpi()
world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
rank = world.Get_rank()
other = MPI.Exception(MPI.ERR_OTHER)
before = ulfm.is_peer_failure(other)
world.Barrier()
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    req = world.Ibarrier()
    while not req.Test():
        pass
except MPI.Exception:
    pass  # the failure, found
after = ulfm.is_peer_failure(RuntimeError("a wrapper"))  # the chain: nothing MPI in it
print(f"rank {rank}: before {before}, after {ulfm.is_peer_failure(other)}, plain {after}",
      flush=True)
os._exit(0 if not before and ulfm.is_peer_failure(other) and not after else 1)
