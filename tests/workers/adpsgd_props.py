"""Worker: ADPSGD invariants. Usage: adpsgd_props.py MODE OUTDIR.

conserve  : constant per-rank gradients, plain SGD, jittered gossip; after close() the sum of
            all replicas must be S*w0 - lr*T*sum_r g_r; super-learner replicas bit-identical
            after every step.
consensus : lr 0 and different starting replicas per super-learner: spread after close.
stall     : rank 0 stalls after its first step until rank 1 has finished all its steps.
dead      : rank 2 freezes (SIGSTOP) after 3 steps; the others must fail within the
            deadline, naming it.
Each rank writes OUTDIR/rank<r>.json with what the test checks. ``ADPSGD_TEST_WIRE`` sets
the gossip's wire format (default fp32; with topk ``ADPSGD_TEST_GOSSIP_STEP`` CHOCO's step
and ``ADPSGD_TEST_TOPK`` the fraction), ``ADPSGD_TEST_STALENESS`` its ``max_staleness``
(default 0: unbounded), ``ADPSGD_TEST_JITTER`` the gossip's random delay (default 4 ms);
each leader records the largest staleness of its gossip in flight it ended a step with (the
steps since the snapshot of a delta not yet applied) and the steps at which it waited.

MODE ``cases`` runs several conserve/consensus cases of one layout in one launch, one after
another, each on a new ADPSGD (and its own pair channel) over the same topology: the JSON list
in ``ADPSGD_TEST_CASES`` names each case and overrides the variables above
(``{"name": ..., "mode": ..., "ADPSGD_TEST_STEPS": ...}``); each writes
``OUTDIR/<name>/rank<r>.json``. Launches are most of the multi-rank suite's time (each rank
imports torch), so the cases of one layout share one.
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from hadpsgd import comm
from hadpsgd.algorithms import ADPSGD

mode, out = sys.argv[1], Path(sys.argv[2])
topo = comm.init(device=os.environ.get("HADPSGD_TEST_DEVICE", "cpu"))
r = topo.rank


def run_case(mode: str, out: Path, setting: dict[str, str]) -> ADPSGD:
    """One case: ``setting`` holds the ``ADPSGD_TEST_*`` values (the environment's default).

    Returns the closed algorithm (``gossip_link.py`` reads its gossip thread's counts).
    """

    def get(name: str, default: str) -> str:
        return setting.get(name, os.environ.get(name, default))

    torch.manual_seed(0)
    model = torch.nn.Linear(40, 25).double().to(topo.device)  # 1025 parameters, one dtype
    lr = 0.0 if mode == "consensus" else 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    max_staleness = int(get("ADPSGD_TEST_STALENESS", "0"))
    jitter = float(get("ADPSGD_TEST_JITTER", "0.004"))
    algo = ADPSGD(model, opt, topo, gossip_jitter=jitter, max_staleness=max_staleness,
                  wire=get("ADPSGD_TEST_WIRE", "fp32"),
                  gossip_step=float(get("ADPSGD_TEST_GOSSIP_STEP", "1")),
                  gossip_graph=get("ADPSGD_TEST_GRAPH", "ring"),
                  topk_fraction=float(get("ADPSGD_TEST_TOPK", "0.015625")))
    w0 = algo.flat.clone()
    if mode == "consensus":  # different starting replicas, identical inside a super-learner
        algo.flat.add_(torch.linspace(-1, 1, algo.flat.numel(), dtype=torch.float64,
                                      device=topo.device) * topo.node)
    steps = int(get("ADPSGD_TEST_STEPS", "40"))
    g = torch.full_like(algo.flat, 0.01 * (r + 1))  # constant, different on every rank
    record = {"rank": r, "node": topo.node, "identical": True, "max_staleness_seen": 0}
    try:
        for step in range(steps):
            time.sleep(0.01)  # stands in for forward/backward, so gossip overlaps compute
            algo.grads.buffers[torch.float64].copy_(g)  # as if backward() produced g
            algo.step()
            algo.grads.zero_()
            if algo.thread is not None:
                # It can only shrink until the next step (a new snapshot is 0 steps old).
                record["max_staleness_seen"] = max(record["max_staleness_seen"],
                                                   algo.thread.staleness_in_flight())
            if mode == "conserve" and topo.local_size > 1:
                digest = hashlib.sha256(algo.flat.cpu().numpy().tobytes()).hexdigest()
                record["identical"] &= len(set(topo.intra.allgather(digest))) == 1
            if mode == "stall" and r == 0 and step == 0:
                flag = out / "rank1.done"
                deadline = time.monotonic() + 120
                while not flag.exists():  # a global barrier anywhere would deadlock here
                    if time.monotonic() > deadline:
                        print("STALL TIMEOUT: rank 1 never finished", flush=True)
                        os._exit(4)
                    time.sleep(0.05)
            if mode == "dead" and r == 2 and step == 3:
                # Frozen without a word, like a node that died under it. (A rank that exits is
                # noticed by mpirun itself, which ends the job; a frozen one only by deadlines.)
                os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "stall" and r == 1:
            (out / "rank1.done").write_text("done")
        record["finished_steps_at"] = time.time()
        algo.close()
    except Exception as err:  # noqa: BLE001
        print(f"FAILED rank {r}: {err}", flush=True)
        (out / f"rank{r}.json").write_text(json.dumps({"rank": r, "error": str(err)}))
        if mode == "dead":
            # The property is that every live peer names the frozen rank by its own deadline.
            # The first rank to exit makes the launcher end the job (MPICH's Hydra at once),
            # which could cut off a peer whose deadline started a moment later: wait for their
            # reports.
            until = time.monotonic() + 60
            while (len(list(out.glob("rank*.json"))) < topo.size - 1
                   and time.monotonic() < until):
                time.sleep(0.05)
        os._exit(3)
    record["flat"] = algo.flat.tolist()
    record["w0"] = w0.tolist()
    record["g"] = float(g[0])
    record["lr"] = lr
    record["steps"] = steps
    record["exchanges"] = algo.thread.exchanges if algo.thread else 0
    record["partners"] = sorted(algo.thread.partners) if algo.thread else []
    record["rounds"] = algo.thread.rounds if algo.thread else 0
    record["linked"] = algo.thread.channel.linked if algo.thread else 0  # on a host group
    record["wire_bytes"] = algo.metrics()["wire_bytes"]
    record["stale_waits"] = algo.stale_waits
    (out / f"rank{r}.json").write_text(json.dumps(record))
    print(f"OK rank {r} exchanges={record['exchanges']}", flush=True)
    return algo


if mode == "cases":
    for case in json.loads(os.environ["ADPSGD_TEST_CASES"]):
        where = out / case["name"]
        where.mkdir(parents=True, exist_ok=True)
        algo = run_case(case["mode"], where, {k: str(v) for k, v in case.items()
                                              if k.startswith("ADPSGD_TEST_")})
else:
    algo = run_case(mode, out, {})
