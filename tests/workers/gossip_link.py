"""Worker: adpsgd_props with a host group between super-learners of one host (gloo standing
in for NCCL, ``_standin.py``; ``HOST_LINK_HOSTS`` pretend hosts).

Runs ``adpsgd_props.py MODE OUTDIR`` as it is, then prints ``gossip rank r host link L
channel MPI M rounds k``: whether the topology has the host group, whether the gossip's pair
channel is MPI's alone (the gossip thread launches no NCCL: comm/hostlink.py, *One thread
launches NCCL*), and the exchanges made.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _standin  # noqa: E402 - the workers' folder, above

from hadpsgd.comm.pair import PairChannel  # noqa: E402

done = _standin.run("adpsgd_props.py", sys.argv[1:])
thread = done["algo"].thread
if thread is not None:
    channel = thread.channel
    mpi_only = type(channel) is PairChannel and not hasattr(channel, "link")
    print(f"gossip rank {done['r']} host link {_standin.made[0].local is not None} "
          f"channel MPI {mpi_only} rounds {thread.rounds}", flush=True)
