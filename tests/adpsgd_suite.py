"""ADPSGD's invariants as one function of a world (MPI's or threads'): :func:`run_case`.

Modes: ``conserve`` (constant per-rank gradients, plain SGD, jittered gossip; after
``close()`` the sum of all replicas must be S*w0 - lr*T*sum_r g_r; super-learner replicas
bit-identical after every step), ``consensus`` (lr 0, different starting replicas per
super-learner: their spread after close), and, under mpirun only, ``stall`` (rank 0 stalls
after its first step until rank 1 has finished all its steps) and ``dead`` (rank 2 freezes,
SIGSTOP, after 3 steps; the others must fail within the deadline, naming it). ``setting``
(else the environment) gives ``ADPSGD_TEST_STEPS``, ``_WIRE``, ``_GOSSIP_STEP``, ``_TOPK``,
``_STALENESS``, ``_JITTER`` and ``_GRAPH``. Each learner writes ``OUT/rank<r>.json`` with
what the tests check; each leader records the largest staleness of its gossip in flight it
ended a step with and the steps at which it waited.

``tests/unit/test_adpsgd_threads.py`` runs the conserve and consensus cases on learners as
threads; ``tests/workers/adpsgd_props.py`` runs every mode under mpirun.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from hadpsgd.algorithms import ADPSGD
from hadpsgd.comm import World


def run_cases(topo: World, cases: list[dict], out: Path, exit_on_error: bool = True) -> ADPSGD:
    """Several cases one after another, each on a new ADPSGD over ``topo``: ``cases`` holds
    ``{"name": ..., "mode": ..., "ADPSGD_TEST_...": value}``; each writes ``out/<name>/``.
    Returns the last case's algorithm."""
    algo = None
    for case in cases:
        where = out / case["name"]
        where.mkdir(parents=True, exist_ok=True)
        algo = run_case(topo, case["mode"], where, {k: str(v) for k, v in case.items()
                                                   if k.startswith("ADPSGD_TEST_")},
                        exit_on_error=exit_on_error)
    assert algo is not None, "no case to run"
    return algo


def run_case(topo: World, mode: str, out: Path, setting: dict[str, str],
             exit_on_error: bool = True) -> ADPSGD:
    """One case on ``topo``; ``setting`` holds the ``ADPSGD_TEST_*`` values (the
    environment's by default). Writes ``out/rank<r>.json``.

    Returns the closed algorithm (``gossip_link.py`` reads its gossip thread's counts). A
    failure is printed and ends the process (exit 3) under mpirun; with ``exit_on_error``
    False (learners as threads) it is raised.
    """
    r = topo.rank

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
                # Bit for bit the node leader's replica (a node-level collective only).
                leaders = algo.flat.clone()
                topo.intra_broadcast_(leaders, root=0)
                record["identical"] &= bool(torch.equal(leaders, algo.flat))
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
        if not exit_on_error:
            raise
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
    record["wire_bytes"] = algo.metrics()["wire_bytes"]
    record["stale_waits"] = algo.stale_waits
    (out / f"rank{r}.json").write_text(json.dumps(record))
    print(f"OK rank {r} exchanges={record['exchanges']}", flush=True)
    return algo
