"""The plan of ``scripts/gpu_check.py``: every check, its time limit and the time it needs.

In the order they run, most telling first, so that what the budget leaves out is the least
telling: the NCCL checks and ``pytest tests/gpu`` first, then the single-GPU checks and
benchmarks, ``swb``'s speed per layout and precision, every algorithm on ``small`` (stopped
half-way and resumed), mixed precision on ``small``, and ``train_throughput`` last. ``need`` is
what each took on one H100 (2026-11-24 report, docs/data/gpu-check-h100.md): a check starts
only while that much of the budget is left.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_check import Runner

SINGLE_NCCL = """
import torch
from mpi4py import MPI
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.nccl import NCCLIntra
w = Watchdog(MPI.COMM_WORLD.Dup(), 30.0)
dev = torch.device('cuda', 0)
torch.cuda.set_device(dev)
b = NCCLIntra(MPI.COMM_SELF.Dup(), w, [0], dev)
t = torch.arange(1000, dtype=torch.float32, device=dev)
b.allreduce_(t); b.bcast_(t)
b.allreduce_deferred_(t, avg=True); b.join(); torch.cuda.synchronize()
assert torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32)), t
b.close()
print('one-rank NCCL group: allreduce, broadcast and a deferred mean are the identity')
"""

CUDNN_WARN = """
import warnings, torch
from hadpsgd.comm.flat import FlatBuffer, cudnn_weight_groups
from hadpsgd.models import build_model
bad = []
for preset in ('small', 'swb'):
    m = build_model(preset, 260, 64, per_layer=True).cuda()
    # The layout the trainer gives the parameters (algorithms.base): one flat buffer.
    flat = FlatBuffer(list(m.parameters()), kind='data',
                      own_storage=cudnn_weight_groups(m))
    x = torch.randn(8, 21, 260, device='cuda')
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        for _ in range(2):
            m(x).float().logsumexp(-1).mean().backward()
        torch.cuda.synchronize()
    msgs = [str(w.message) for w in seen if 'contiguous chunk' in str(w.message)]
    print(preset, 'per-layer: cuDNN weight warnings:', len(msgs))
    bad += msgs
assert not bad, bad[0]
"""


@dataclass(frozen=True)
class Item:
    """One check of the plan."""

    key: str
    """Its name for ``--only``."""
    name: str
    """Its row in the report."""
    limit: float
    """Seconds it may take (a hang ends there)."""
    need: float
    """Seconds it takes when it passes on one H100 (2026-11): it starts only with these left."""
    run: Callable[[float], object]
    """Runs it with its time limit."""
    gpus: int = 1
    """GPUs it needs (with fewer it is reported as needing them, which is no failure)."""


def plan(run: Runner, gpus: int, work: Path, quick: bool) -> list[Item]:
    """Every check, most telling first; ``need`` is its time on one H100 (2026-11)."""
    steps = 40 if quick else 200
    n = max(2, gpus)  # ranks share the GPU when there is one
    adam = ["--algo", "bmuf", "--ranks-per-node", "1", "--optimizer", "adam", "--lr", "0.001",
            "--sync-period", "8"]
    swb = ["--algo", "ssgd", "--batch-size", "16"]

    def train(name: str, nprocs: int, args: list[str], resume: bool = True,
              preset: str = "small") -> Callable[[float], object]:
        # swb: 30 steps, a window every 5 (the first, its warm-up, is left out of frames/s).
        more = dict(preset="swb", log_every=5) if preset == "swb" else {}
        return lambda limit: run.train(name, nprocs, args, 30 if preset == "swb" else steps,
                                       resume=resume, timeout=limit, **more)

    ttp_cmd = [sys.executable, "benchmarks/train_throughput.py", "--device", "cuda",
               "--presets", "swb", "--ranks", "1", "--precision", "fp32", "bf16", "--steps",
               "20", "--warmup", "3", "--json", str(work / "ttp.json")]
    tt_cmd = [sys.executable, "benchmarks/train_throughput.py", "--device", "cuda",
              "--presets", "small", "swb", "--ranks", "1", str(gpus), "--steps", "20",
              "--warmup", "3", "--json", str(work / "tt.json")]
    comm_cmd = [sys.executable, "-m", "benchmarks.comm", "-n", str(n), "--device", "cuda",
                "--op", "allreduce", "-b", "4K", "-e", "64M", "-f", "8",
                "--json", str(work / "comm.json")]
    return [
        Item("machine", "machine check", 120, 10, lambda _: run.machine()),
        Item("nccl1", "one-rank NCCL group", 120, 10, lambda t: run.python(
            "one-rank NCCL group through NCCLIntra", SINGLE_NCCL, t)),
        Item("nccl", "NCCL intra-node training (one rank per GPU)", 150, 35, lambda t: run.train(
            "ssgd small nccl", gpus, ["--algo", "ssgd", "--intra-backend", "nccl"], steps,
            timeout=t), 2),
        Item("pytest", "pytest tests/gpu", 330, 120, run.pytest),
        Item("cudnn", "no cuDNN weight copy", 180, 10, lambda t: run.python(
            "no cuDNN weight copy with per-layer small and swb", CUDNN_WARN, t)),
        Item("comm", "benchmarks.comm --device cuda", 180, 20, lambda t: run.bench(
            "benchmarks.comm --device cuda", comm_cmd, work / "comm.json", t)),
        Item("tt", "train_throughput vs DDP-NCCL", 300, 150, lambda t: run.bench(
            "train_throughput vs DDP-NCCL", tt_cmd, work / "tt.json", t,
            ("default", "fp32", "torch default")), 2),
        # swb's step time per layout, at bf16 and with TF32: the figures docs/gpu.md reports.
        Item("swb1", "ssgd swb per-layer", 150, 35, train(
            "ssgd swb 1 rank (per-layer LSTM)", 1, swb, preset="swb")),
        Item("swbs", "ssgd swb stacked", 100, 20, train(
            "ssgd swb 1 rank (stacked LSTM)", 1, [*swb, "--lstm-layout", "stacked"],
            resume=False, preset="swb")),
        Item("swbbf16", "ssgd swb bf16", 100, 20, train(
            "ssgd swb 1 rank bf16 (per-layer LSTM)", 1, [*swb, "--precision", "bf16"],
            resume=False, preset="swb")),
        Item("swbtf32", "ssgd swb --tf32", 100, 20, train(
            "ssgd swb 1 rank fp32 --tf32 (per-layer LSTM)", 1, [*swb, "--tf32"],
            resume=False, preset="swb")),
        Item("ssgd1", "ssgd small 1 rank", 150, 35, train("ssgd small 1 rank", 1,
                                                       ["--algo", "ssgd"])),
        Item("ssgdn", "ssgd small n ranks", 150, 35, train(f"ssgd small {n} ranks", n,
                                                        ["--algo", "ssgd"])),
        Item("adpsgd", "adpsgd small", 150, 35, train("adpsgd small", n, [
            "--algo", "adpsgd", "--super-learner-size", "1"])),
        Item("hadpsgd", "h-adpsgd small 2x2", 150, 35, train("h-adpsgd small 2x2", 4, [
            "--algo", "adpsgd", "--super-learner-size", "2", "--ranks-per-node", "2"])),
        Item("bmuf", "bmuf-adam small", 150, 35, train("bmuf-adam small", n, adam)),
        Item("bmufo", "bmuf-adam small overlap int8", 150, 35, train(
            "bmuf-adam small overlap int8", n, [*adam, "--bmuf-overlap", "--wire", "int8"])),
        Item("swbn", "bmuf-adam swb n ranks", 100, 25, train(
            f"bmuf-adam swb {n} ranks", n, [*adam, "--batch-size", "16"], resume=False,
            preset="swb")),
        # Mixed precision on small (issue 27); tests/gpu trains every algorithm at bf16 and
        # fp16 too, so only fp16 (its loss scale is in the checkpoint) is resumed here.
        Item("fp16", "ssgd small fp16", 150, 35, train("ssgd small 1 rank fp16", 1, [
            "--algo", "ssgd", "--precision", "fp16"])),
        Item("bf16", "ssgd small bf16", 100, 20, train("ssgd small 1 rank bf16", 1, [
            "--algo", "ssgd", "--precision", "bf16"], resume=False)),
        Item("gwire", "ssgd bf16 + grad-wire bf16", 100, 20, train(
            f"ssgd small {n} ranks bf16 + grad-wire bf16", n, [
                "--algo", "ssgd", "--precision", "bf16", "--grad-wire", "bf16"],
            resume=False)),
        Item("bmuf16", "bmuf-adam small fp16", 100, 20, train("bmuf-adam small fp16", n, [
            *adam, "--precision", "fp16"], resume=False)),
        Item("ttp", "train_throughput swb fp32 vs bf16 vs DDP", 300, 90, lambda t: run.bench(
            "train_throughput swb fp32 vs bf16 vs DDP autocast", ttp_cmd, work / "ttp.json",
            t, ("8", "fp32, bf16", "torch default"))),
    ]


