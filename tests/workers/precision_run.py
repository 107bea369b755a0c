"""Worker: a run assembled as ``python -m hadpsgd.run`` assembles it; every rank's end state.

Arguments are the run's flags. The configuration, topology and trainer are built exactly as
``hadpsgd.run.main`` builds them (``parse_config``, ``comm.init`` with the algorithm's layout,
``build_trainer``), the training runs to its end, and rank 0 prints one ``STATE`` line: every
rank's ``tests.trainer_threads.end_state`` (the same states a thread world's run returns).
The tests decide from that which replicas must be identical.
"""

import json
import sys

from hadpsgd import comm
from hadpsgd.assembly import build_trainer
from hadpsgd.config import parse_config
from tests.trainer_threads import train

cfg = parse_config(sys.argv[1:])
options = cfg.algo_options()
topo = comm.init(options.ranks_per_node() or cfg.comm.ranks_per_node, cfg.comm.device,
                 cfg.comm.intra_backend, cfg.comm.hier_algo, cfg.comm.bucket_mb)
every = topo.allgather_object(train(build_trainer(cfg, topo), topo))
if topo.rank == 0:
    print("STATE " + json.dumps(every), flush=True)
