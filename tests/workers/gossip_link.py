"""Worker: adpsgd_props with the leaders' gossip between super-learners of one host on a
host group (gloo standing in for NCCL, ``_standin.py``; ``HOST_LINK_HOSTS`` pretend hosts).

Runs ``adpsgd_props.py MODE OUTDIR`` as it is, then prints ``gossip rank r linked k mpi m``:
the exchanges that took the host group and those that crossed hosts over MPI, and
``partners {node: exchanges}`` (which neighbours it swapped with).
"""

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _standin  # noqa: E402 - the workers' folder, above

_standin.install(int(os.environ.get("HOST_LINK_HOSTS", "1")))
sys.argv = [os.path.join(os.path.dirname(__file__), "adpsgd_props.py"), *sys.argv[1:]]
done = runpy.run_path(sys.argv[0], run_name="__main__")
thread = done["algo"].thread
if thread is not None:
    linked = thread.channel.linked
    print(f"gossip rank {done['r']} linked {linked} mpi {thread.rounds - linked} "
          f"partners {json.dumps(dict(thread.partners))}", flush=True)
