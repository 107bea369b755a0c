"""Frames/s and bytes per step of BMUF at several sync periods, SSGD, and local-only training.

Run by ``benchmarks/bmuf.py`` (:mod:`benchmarks.training.bmuf`) under mpirun: every mode runs
in this one process, one after the other, on the same ranks, model and per-rank batch (random
in-memory data, so only compute and communication are measured). Bytes are the payloads handed
to the topology's collectives, counted by wrapping them (BMUF: the bytes its block syncs sent,
compressed or not); on two emulated hosts also the bytes that crossed the link. Rank 0 prints
one JSON line per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._common.timing import seconds_per_step, training_step, warm_up
from hadpsgd import comm, env
from hadpsgd.algorithms import BMUF, SSGD
from hadpsgd.models import build_model


class ByteCounter:
    """Wraps a topology's collectives and adds up the bytes of the tensors passed to them."""

    # world allreduce and inter-node allreduce cross super-learners; intra stays in a node
    CROSSING = {"allreduce_": True, "inter_allreduce_": True, "intra_allreduce_": False}

    def __init__(self, topo: comm.Topology) -> None:
        self.inter = 0
        self.intra = 0
        for name, crossing in self.CROSSING.items():
            setattr(topo, name, self._wrap(getattr(topo, name), crossing))

    def _wrap(self, fn: Callable[..., Any], crossing: bool) -> Callable[..., Any]:
        def counted(t: torch.Tensor, *args: Any, **kw: Any) -> Any:
            nbytes = t.numel() * t.element_size()
            if crossing:
                self.inter += nbytes
            else:
                self.intra += nbytes
            return fn(t, *args, **kw)

        return counted

    def reset(self) -> None:
        """Start counting from zero."""
        self.inter = self.intra = 0


def bmuf_options(mode: str) -> dict[str, Any]:
    """``bmuf-tau8+overlap+frag4+int8`` -> BMUF's keywords."""
    head, *variants = mode.split("+")
    out: dict[str, Any] = {"sync_period": int(head[len("bmuf-tau"):])}
    for v in variants:
        if v == "overlap":
            out["block_overlap"] = True
        elif v.startswith("frag"):
            out["fragments"] = int(v[len("frag"):])
        elif v in ("bf16", "int8", "int4", "sign", "topk"):
            out["wire"] = v
        elif v.startswith("topk"):  # topk0.004: top-k at that fraction
            out["wire"], out["topk_fraction"] = "topk", float(v[len("topk"):])
        else:
            raise SystemExit(f"unknown BMUF variant {v!r} in {mode!r} (overlap, fragF, bf16, "
                             "int8, int4, sign, topk, topkF)")
    return out


def wire_bytes(algo: Any) -> int:
    """Payload bytes BMUF sent across super-learners so far (this rank); 0 for the others."""
    return int(algo.wire_bytes) if isinstance(algo, BMUF) else 0


def link_tx_bytes(topo: comm.Topology) -> int:
    """Bytes this host sent on its network links (local rank 0 reads them; others say 0).

    On two emulated hosts the only link of a namespace is its end of the veth pair, so this
    is what crossed the inter-node link; elsewhere it is whatever the machine sent.
    """
    if topo.local_rank != 0:
        return 0
    total = 0
    for dev in Path("/sys/class/net").iterdir():
        if dev.name != "lo":
            with contextlib.suppress(OSError, ValueError):
                total += int((dev / "statistics" / "tx_bytes").read_text())
    return total


def measure(mode: str, a: argparse.Namespace, topo: comm.Topology, counter: ByteCounter,
            x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One timed run of ``mode``: seconds per step (slowest rank) and the bytes it moved."""
    torch.manual_seed(0)
    model = build_model(a.preset, a.feat_dim, a.classes)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.5, 0.999))
           if a.optimizer == "adam" else
           torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    algo: Any = None
    if mode == "ssgd":
        algo = SSGD(model, opt, topo)
    elif mode.startswith("ssgd-pipe"):  # ssgd-pipe4: the pipelined mean, 4 MiB pieces
        before = os.environ.get(env.PIPELINE_MB)
        os.environ[env.PIPELINE_MB] = mode[len("ssgd-pipe"):]  # read when SSGD is built
        try:
            algo = SSGD(model, opt, topo)
        finally:
            os.environ.pop(env.PIPELINE_MB)
            if before is not None:
                os.environ[env.PIPELINE_MB] = before
    elif mode.startswith("bmuf"):
        algo = BMUF(model, opt, topo, adam_moments=a.adam_moments, **bmuf_options(mode))
    step = training_step(model, opt, x, y, a.classes, algo)  # algo None: local-only
    warm_up(step, a.warmup)
    counter.reset()  # the barrier below hands no bytes to the counted collectives
    wire0, link0 = wire_bytes(algo), link_tx_bytes(topo)
    sec = seconds_per_step(step, a.steps, barrier=topo.barrier)
    if isinstance(algo, BMUF):
        # An overlapped mean still in flight belongs to the timed steps: wait for it.
        tic = time.perf_counter()
        algo.wait_in_flight()
        sec += (time.perf_counter() - tic) / a.steps
    sec = max(topo.allgather_object(sec))  # the slowest rank sets the pace
    sent = wire_bytes(algo) - wire0
    # Bytes that really left each host over the emulated link (two hosts only).
    link = sum(topo.allgather_object(link_tx_bytes(topo) - link0))
    if algo is not None:
        algo.close()
    return {"sec": sec, "inter": sent if mode.startswith("bmuf") else counter.inter,
            "intra": counter.intra, "link": link,
            "params": sum(q.numel() for q in model.parameters())}


def main() -> None:
    """Parse the options, run every mode on this rank, print one JSON line per mode (rank 0)."""
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    p.add_argument("--adam-moments", default="corrected")
    p.add_argument("--taus", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--variants", nargs="*", default=[],
                   help="BMUF variants at --variant-tau: overlap, fragF, bf16, int8, int4, "
                        "sign, topk, topkF (top-k at fraction F) joined by '+' (e.g. overlap+topk)")
    p.add_argument("--variant-tau", type=int, default=8)
    p.add_argument("--pipeline-mb", nargs="*", default=[],
                   help="also SSGD with the pipelined hierarchical mean at each piece size "
                        "in MiB (HADPSGD_PIPELINE_MB)")
    p.add_argument("--steps", type=int, default=64, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="runs of every mode, in turn")
    p.add_argument("--chunk-len", type=int, default=21)
    p.add_argument("--feat-dim", type=int, default=260)
    a = p.parse_args()

    topo = comm.init(device="cpu")
    counter = ByteCounter(topo)
    x = torch.randn(a.batch, a.chunk_len, a.feat_dim, generator=torch.Generator().manual_seed(
        topo.rank))
    y = torch.randint(0, a.classes, (a.batch, a.chunk_len))
    modes = ["local", "ssgd", *[f"ssgd-pipe{mb}" for mb in a.pipeline_mb],
             *[f"bmuf-tau{t}" for t in a.taus],
             *[f"bmuf-tau{a.variant_tau}+{v}" for v in a.variants]]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    # Rounds of every mode in turn: the machine drifts over a job (the first mode often runs
    # slow), so each mode's figure is its median over rounds spread through the job.
    for _ in range(a.rounds):
        for mode in modes:
            results[mode].append(measure(mode, a, topo, counter, x, y))
    for mode in modes:
        runs = results[mode]
        sec = statistics.median(r["sec"] for r in runs)
        last = runs[-1]
        if topo.rank == 0:
            print(json.dumps({
                "mode": mode, "preset": a.preset, "ranks": topo.size,
                "nodes": topo.num_nodes, "optimizer": a.optimizer,
                "params": last["params"], "batch_per_rank": a.batch, "sec_per_step": sec,
                "sec_per_step_rounds": [r["sec"] for r in runs],
                "frames_per_s": a.batch * a.chunk_len * topo.size / sec,
                "inter_bytes_per_step": last["inter"] / a.steps,
                "link_bytes_per_step": (last["link"] / a.steps if len(set(topo.hosts)) > 1
                                        else None),
                "intra_bytes_per_step": last["intra"] / a.steps,
            }), flush=True)
    topo.close()


if __name__ == "__main__":
    main()
