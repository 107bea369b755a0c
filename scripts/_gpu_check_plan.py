"""The plan of ``scripts/gpu_check.py``: every check, its part, time limit and the time it needs.

A lent GPU machine gives a session about 15 minutes of device time and at most 10 minutes a
command, so the plan is cut in two parts, each one command that fits :data:`DEFAULT_BUDGET_S`:

- **part 1** (``bash scripts/gpu_check.sh``, the default): what must hold for the GPU to be
  trusted at all. The machine check, the NCCL checks (a one-rank group; with two or more GPUs
  training over NCCL), ``pytest tests/gpu``, one run of each algorithm on ``small`` (SSGD,
  ADPSGD, H-ADPSGD, BMUF-Adam), ``swb`` at bf16 (the LSTM in bf16 on cuDNN, and its speed).
  About 420 s on one H200 (455 s with two or more GPUs, where NCCL training runs).
- **part 2** (``bash scripts/gpu_check.sh --part 2``): the figures and the second opinions.
  The cuDNN weight-copy probe, ``benchmarks.comm``, DDP against SSGD over NCCL (two or more
  GPUs), ``swb``'s step time per LSTM layout (stacked against per-layer) and with ``--tf32``,
  SSGD on one rank, BMUF-Adam overlapped on the int8 wire, fp16 (resumed: its loss scale is in
  the checkpoint) and bf16 on ``small``, BMUF-Adam on ``swb``, bf16 on the gradient wire, fp16
  BMUF-Adam and ``train_throughput`` of ``swb`` at fp32 against bf16 against DDP. About 386 s
  on one GPU (536 s with two or more GPUs, where DDP against SSGD runs).

In each part the checks run most telling first, so that what the budget cuts is the least
telling. ``need`` is each check's time on one GPU: where one H200 measured it (2026-11-28,
docs/data/gpu-check-h200-2.md: part 1's pytest and training runs, and the three runs moved
from part 1 to part 2 then, when tests/gpu had grown to 253 s and part 1 no longer fitted
its 420 s), that time; else one H100's (the 2026-11-24 report,
docs/data/gpu-check-h100.md, and its ADPSGD re-run): a check starts only while that much of
the budget is left, and the sum of a part's ``need`` is its estimate (:func:`estimate`). From
that report: a ``small`` run of 200 steps stopped half-way and resumed took 33-35 s (two
launches of ~15 s start-up, 100 steps at 13-27 ms), so one launch of 200 steps is ~20 s; the
30-step ``swb`` runs resumed took 31-34 s, one launch of 30 steps ~20 s; BMUF-Adam on ``swb``
on two ranks 43 s resumed, ~25 s in one launch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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
for preset, per_layer in [(p, l) for p in ('small', 'swb') for l in (False, True)]:
    layout = 'per-layer' if per_layer else 'stacked'
    m = build_model(preset, 260, 64, per_layer=per_layer).cuda()
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
    print(preset, layout + ': cuDNN weight warnings:', len(msgs))
    bad += msgs
assert not bad, bad[0]
"""


DEFAULT_BUDGET_S = 540.0
"""``--budget``'s default: a lent machine runs one command for at most 10 minutes, and making
``.venv-gpu`` before the checks start takes some of them."""
PART_TARGET_S = 420.0
"""What each part's checks may need on one H100, in all: the rest of the budget (two
minutes) is for a slower machine or start, and for tests added to tests/gpu since the
estimates were measured."""
PARTS = ("1", "2", "3", "all")
"""Values of ``--part``: ``3`` is the shared-GPU plan (NCCL between ranks on one GPU); ``all``
is every part in one command (past the default budget, so give it ``--budget``)."""

SHARE_ENV = {"HADPSGD_SHARE_GPU": "1"}
"""Part 3's setting: the ranks on the one GPU as GPUs of their own, on one pretend host."""

SHARE_VERSIONS = """
import torch
from hadpsgd.comm.nccl import nccl_available
ok, why = nccl_available()
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL',
      '.'.join(map(str, torch.cuda.nccl.version())), 'GPUs', torch.cuda.device_count(),
      torch.cuda.get_device_name(0))
assert ok, why
print('NCCL available; HADPSGD_SHARE_GPU=1 runs the ranks on this GPU as GPUs of their own '
      '(sockets on loopback): bits, not speed')
"""

SHARE_TESTS = ("tests/gpu/test_gpu_comm.py", "tests/gpu/test_gpu_elastic.py",
               "tests/gpu/test_gpu_share.py")
"""tests/gpu's files with NCCL between two or more ranks: run in the shared mode by part 3."""


class Runner(Protocol):
    """What the plan calls to run a check: ``gpu_check.Runner`` is one, the tests' fake another.

    Named here, not imported from ``gpu_check`` (which imports this module): a circle, even
    under ``TYPE_CHECKING``, ties the two files into one.
    """

    def machine(self) -> None:
        """``python -m hadpsgd.comm`` on one rank."""

    def pytest(self, limit: float, paths: Sequence[str] = ("tests/gpu",),
               keyword: str | None = None, env: Mapping[str, str] | None = None,
               name: str = "pytest tests/gpu") -> None:
        """``pytest tests/gpu`` within ``limit`` seconds (or ``paths``, ``-k keyword``, ``env``)."""

    def train(self, name: str, nprocs: int, args: list[str], steps: int,
              resume: bool = True, preset: str = "small", timeout: float = 150,
              log_every: int = 20) -> None:
        """One training through ``python -m hadpsgd.run --device cuda``."""

    def python(self, name: str, code_text: str, timeout: float = 120) -> None:
        """A single-process check written in Python."""

    def bench(self, name: str, cmd: list[str], json_out: Path, timeout: float,
              settings: tuple[str, str, str] = ("-", "-", "-")) -> None:
        """A benchmark command, its table kept."""


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
    part: int = 1
    """The part of the plan it runs in (``--part``)."""


def chosen(item: Item, part: str, only: set[str] | None = None) -> bool:
    """Whether this command runs ``item``: its keys with ``--only``, else its ``--part``.

    Args:
        item: A check of the plan.
        part: ``--part``: ``1``, ``2`` or ``all``.
        only: ``--only``'s keys, which name checks of any part; ``None`` without it.
    """
    if only is not None:
        return item.key in only
    return part == "all" or str(item.part) == part


def estimate(items: list[Item], gpus: int) -> float:
    """Seconds ``items`` need on one H100 on a machine of ``gpus`` GPUs (those it can run)."""
    return sum(item.need for item in items if item.gpus <= gpus)


def plan(run: Runner, gpus: int, work: Path, quick: bool) -> list[Item]:
    """Every check, part 1 first, each part most telling first; ``need`` is its H100 time."""
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
    def probe_cmd(layout: str) -> list[str]:
        # --cuda-graph's overlap, whole against per stage (issue 59 item 3): swb bf16 at 128.
        return [sys.executable, "-m", "benchmarks.training.graph_probe", "--batch", "128",
                "--precision", "bf16", "--layout", layout, "--windows", "2",
                "--json", str(work / f"graph-{layout}.json")]

    comm_cmd = [sys.executable, "-m", "benchmarks.comm", "-n", str(n), "--device", "cuda",
                "--op", "allreduce", "-b", "4K", "-e", "64M", "-f", "8",
                "--json", str(work / "comm.json")]
    return [
        # ---- part 1: what must hold for the GPU to be trusted (~420 s on one H200).
        Item("machine", "machine check", 120, 10, lambda _: run.machine()),
        Item("nccl1", "one-rank NCCL group", 120, 10, lambda t: run.python(
            "one-rank NCCL group through NCCLIntra", SINGLE_NCCL, t)),
        Item("nccl", "NCCL intra-node training (one rank per GPU)", 150, 35, lambda t: run.train(
            "ssgd small nccl", gpus, ["--algo", "ssgd", "--intra-backend", "nccl"], steps,
            timeout=t), 2),
        # 253 s for its 62 tests on one H200 (2026-11-28, 4 xdist workers; 113 s for 25 tests
        # on 2026-11-24), then test_gpu_graphs.py's 3 (59 s alone the same day with two epochs
        # a run, ~35 s with the one they now take: ~10 s more in 4 workers). The limit leaves
        # the rest of part 1 its time in the budget when a test hangs.
        # Added since, not yet timed on a GPU (PART_TARGET_S's slack is for them):
        # test_gpu_comm.py's pipelined device means (one 4-rank launch, 2026-11-29).
        Item("pytest", "pytest tests/gpu", 340, 265, run.pytest),
        # One run of each algorithm, in one launch: tests/gpu stops and resumes each of them
        # on CUDA already, and the fp16 run below resumes here.
        Item("ssgdn", "ssgd small n ranks", 150, 30, train(f"ssgd small {n} ranks", n,
                                                        ["--algo", "ssgd"], resume=False)),
        Item("adpsgd", "adpsgd small", 150, 27, train("adpsgd small", n, [
            "--algo", "adpsgd", "--super-learner-size", "1"], resume=False)),
        Item("hadpsgd", "h-adpsgd small 2x2", 150, 28, train("h-adpsgd small 2x2", 4, [
            "--algo", "adpsgd", "--super-learner-size", "2", "--ranks-per-node", "2"],
            resume=False)),
        Item("bmuf", "bmuf-adam small", 150, 26, train("bmuf-adam small", n, adam,
                                                       resume=False)),
        # swb at bf16 in the layout users get (stacked, auto's choice): the bf16 LSTM on
        # cuDNN (the check fails where it falls back to fp32) and its frames/s.
        Item("swbbf16", "ssgd swb bf16 stacked", 100, 24, train(
            "ssgd swb 1 rank bf16 (stacked LSTM)", 1,
            [*swb, "--lstm-layout", "stacked", "--precision", "bf16"], resume=False,
            preset="swb")),
        # ---- part 2: the figures and second opinions (~386 s on one GPU, ~536 s on two).
        Item("cudnn", "no cuDNN weight copy", 180, 10, lambda t: run.python(
            "no cuDNN weight copy with stacked and per-layer small and swb", CUDNN_WARN, t),
             part=2),
        Item("comm", "benchmarks.comm --device cuda", 180, 20, lambda t: run.bench(
            "benchmarks.comm --device cuda", comm_cmd, work / "comm.json", t), part=2),
        Item("tt", "train_throughput vs DDP-NCCL", 300, 150, lambda t: run.bench(
            "train_throughput vs DDP-NCCL", tt_cmd, work / "tt.json", t,
            ("default", "fp32", "torch default")), 2, part=2),
        # swb's step time per LSTM layout (per-layer resumed: no default builds it any more),
        # and stacked with TF32 against stacked in IEEE fp32.
        Item("swb1", "ssgd swb per-layer", 150, 35, train(
            "ssgd swb 1 rank (per-layer LSTM)", 1, [*swb, "--lstm-layout", "per-layer"],
            preset="swb"), part=2),
        Item("swbs", "ssgd swb stacked", 100, 20, train(
            "ssgd swb 1 rank (stacked LSTM)", 1, [*swb, "--lstm-layout", "stacked"],
            resume=False, preset="swb"), part=2),
        Item("swbtf32", "ssgd swb --tf32 stacked", 100, 20, train(
            "ssgd swb 1 rank fp32 --tf32 (stacked LSTM)", 1,
            [*swb, "--lstm-layout", "stacked", "--tf32"], resume=False, preset="swb"),
             part=2),
        # SSGD on one rank in fp32, the anchor of the fp16 and bf16 runs below (fp16 is the
        # one resumed: its loss scale is in the checkpoint).
        Item("ssgd1", "ssgd small 1 rank", 150, 20, train("ssgd small 1 rank", 1,
                                                       ["--algo", "ssgd"], resume=False),
             part=2),
        # The side channel's stream and the int8 wire: a path of its own on the device.
        Item("bmufo", "bmuf-adam small overlap int8", 150, 28, train(
            "bmuf-adam small overlap int8", n, [*adam, "--bmuf-overlap", "--wire", "int8"],
            resume=False), part=2),
        # Mixed precision on small (issue 27): fp16 resumed, bf16.
        Item("fp16", "ssgd small fp16", 150, 52, train("ssgd small 1 rank fp16", 1, [
            "--algo", "ssgd", "--precision", "fp16"]), part=2),
        Item("bf16", "ssgd small bf16", 100, 26, train("ssgd small 1 rank bf16", 1, [
            "--algo", "ssgd", "--precision", "bf16"], resume=False), part=2),
        Item("swbn", "bmuf-adam swb n ranks", 100, 25, train(
            f"bmuf-adam swb {n} ranks", n, [*adam, "--batch-size", "16"], resume=False,
            preset="swb"), part=2),
        # tests/gpu trains ssgd, bmuf-adam and h-adpsgd at bf16 and fp16 with the bf16 wire
        # on tiny data; these are the small-model figures.
        Item("gwire", "ssgd bf16 + grad-wire bf16", 100, 20, train(
            f"ssgd small {n} ranks bf16 + grad-wire bf16", n, [
                "--algo", "ssgd", "--precision", "bf16", "--grad-wire", "bf16"],
            resume=False), part=2),
        Item("bmuf16", "bmuf-adam small fp16", 100, 20, train("bmuf-adam small fp16", n, [
            *adam, "--precision", "fp16"], resume=False), part=2),
        Item("ttp", "train_throughput swb fp32 vs bf16 vs DDP", 300, 90, lambda t: run.bench(
            "train_throughput swb fp32 vs bf16 vs DDP autocast", ttp_cmd, work / "ttp.json",
            t, ("8", "fp32, bf16", "torch default")), part=2),
        # ---- part 3: NCCL between ranks on the one GPU (HADPSGD_SHARE_GPU; issue 59). Not
        # run on a GPU yet: the needs are guesses (a launch ~15 s, NCCL's sockets ~15 ms a
        # collective), to be replaced by the first run's times.
        Item("sversions", "versions and NCCL (shared-GPU plan)", 60, 10, lambda t: run.python(
            "versions and NCCL for the shared-GPU plan", SHARE_VERSIONS, t), part=3),
        Item("sgraph", "capture beside a pinning thread", 120, 30, lambda t: run.pytest(
            t, ("tests/gpu/test_gpu_graphs.py",), keyword="pinning",
            name="the model's capture beside a thread that pins"), part=3),
        # The overlap a graphed backward leaves, whole against per stage (guessed needs).
        Item("gstack", "graph probe swb bf16 stacked: overlap", 120, 25, lambda t: run.bench(
            "graph probe swb bf16 128 stacked (overlap, whole vs stages)",
            probe_cmd("stacked"), work / "graph-stacked.json", t, ("128", "bf16", "-")),
             part=3),
        Item("glayer", "graph probe swb bf16 per-layer: overlap", 120, 25, lambda t: run.bench(
            "graph probe swb bf16 128 per-layer (overlap, whole vs stages)",
            probe_cmd("per-layer"), work / "graph-per-layer.json", t, ("128", "bf16", "-")),
             part=3),
        Item("snccl", "NCCL between ranks on one GPU (HADPSGD_SHARE_GPU=1)", 400, 300,
             lambda t: run.pytest(t, SHARE_TESTS, env=SHARE_ENV,
                                  name="tests/gpu's NCCL tests, HADPSGD_SHARE_GPU=1"), part=3),
    ]
