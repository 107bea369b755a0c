"""Worker: a run assembled as ``python -m hadpsgd.run`` assembles it; every rank's end state.

Arguments are the run's flags. The configuration, topology and trainer are built exactly as
``hadpsgd.run.main`` builds them (``parse_config``, ``comm.init`` with the algorithm's layout,
``build_trainer``), the training runs to its end, and rank 0 prints one ``STATE`` line:
per rank its node, a digest of its local parameters, a digest of the parameters it
evaluates (BMUF's global model), its loss scale, overflow and skipped steps, and its
gradient wire bytes. The tests decide from that which replicas must be identical.
"""

import hashlib
import json
import sys

import torch

from hadpsgd import comm
from hadpsgd.assembly import build_trainer
from hadpsgd.config import parse_config


def digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


cfg = parse_config(sys.argv[1:])
options = cfg.algo_options()
topo = comm.init(options.ranks_per_node() or cfg.comm.ranks_per_node, cfg.comm.device,
                 cfg.comm.intra_backend, cfg.comm.hier_algo, cfg.comm.bucket_mb)
trainer = build_trainer(cfg, topo)
with trainer.algo:
    history = trainer.run()
trainer.close()
trainer.metrics.close()
algo = trainer.algo
with algo.evaluation_parameters() as model:
    evaluated = digest(model)
mine = {"rank": topo.rank, "node": topo.node, "local": digest(algo.model),
        "evaluated": evaluated, "loss_scale": algo.loss_scale,
        "overflow_steps": algo.scaler.overflow_steps if algo.scaler else 0,
        "skipped_steps": algo.skipped_steps, "grad_wire_bytes": algo.gradsync.wire_bytes,
        "heldout_loss": history[-1].loss, "nonfinite": len(trainer.nonfinite)}
every = topo.allgather_object(mine)
if topo.rank == 0:
    print("STATE " + json.dumps(every), flush=True)
