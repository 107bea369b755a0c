"""The checks behind ``scripts/gpu_check.sh``: prove a GPU machine in a few minutes.

Runs, each under its own time limit and in a fresh directory:

1. the start-up lines of ``python -m hadpsgd.run`` and the machine check;
2. ``pytest tests/gpu`` (per test: passed, failed or skipped and why);
3. every algorithm through ``python -m hadpsgd.run --device cuda`` on ``small`` for a few
   hundred steps, stopped half-way and resumed (``--resume auto``), then a few steps of
   ``swb``: SSGD, ADPSGD, H-ADPSGD, BMUF-Adam (blocking, overlapped, int8 wire); mixed
   precision: bf16 and fp16 SSGD, fp16 BMUF-Adam, bf16 gradients on the wire, ``swb`` at
   bf16 and with ``--tf32``, and ``train_throughput`` of ``swb`` at fp32 against bf16
   against DDP under the same autocast (one rank);
4. the single-GPU checks: a one-rank NCCL group through ``NCCLIntra``, no cuDNN weight
   warning with the per-layer LSTM of ``small`` and ``swb``, SSGD on CUDA equal to the
   big-batch single process;
5. ``benchmarks.comm --device cuda`` and, with two or more GPUs, ``train_throughput``
   against DDP over NCCL.

Everything is written to one report (Markdown, with a JSON twin): pass / fail / needs-more-GPUs
per check, step times, the start-up lines and every warning the runs printed (cuDNN's among
them). Exit status 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARNING_RE = re.compile(r"(?i)(warning|not part of a single contiguous chunk|note:)")


@dataclass
class Check:
    """One line of the report."""

    name: str
    """What was checked."""
    status: str = "skipped"
    """``pass``, ``fail``, ``needs N GPUs`` or ``skipped``."""
    seconds: float = 0.0
    """Wall-clock time of the check."""
    detail: str = ""
    """One line: the figure, or why it failed."""
    lines: list[str] = field(default_factory=list)
    """Start-up lines, warnings and the tail of a failure's output."""


class Runner:
    """Runs the checks and collects their results."""

    def __init__(self, work: Path, gpus: int, quick: bool) -> None:
        self.work = work
        self.gpus = gpus
        self.quick = quick
        self.checks: list[Check] = []
        self.env = dict(os.environ, HADPSGD_TIMEOUT=os.environ.get("HADPSGD_TIMEOUT", "60"),
                        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
            self.env.pop(name, None)

    # ------------------------------------------------------------------ plumbing
    def sh(self, cmd: list[str], timeout: float, env: dict[str, str] | None = None
           ) -> tuple[int, str]:
        """Run ``cmd``; return its exit code (124 on timeout) and its whole output."""
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 cwd=ROOT, env={**self.env, **(env or {})})
            return res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or b"") + (err.stderr or b"")
            text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
            return 124, text + f"\n[gpu_check] timed out after {timeout:.0f} s"

    def mpirun(self, nprocs: int, args: list[str]) -> list[str]:
        """``mpirun -np N [local flags] python args...`` with the launcher hadpsgd finds."""
        sys.path.insert(0, str(ROOT))
        from hadpsgd.launch import mpirun_command

        cmd = mpirun_command(nprocs, [], module="x")[:-3]
        return [*cmd, sys.executable, *args]

    def record(self, check: Check, started: float) -> Check:
        """Store ``check`` with its duration and print its line."""
        check.seconds = round(time.monotonic() - started, 1)
        self.checks.append(check)
        mark = {"pass": "PASS", "fail": "FAIL"}.get(check.status, check.status.upper())
        print(f"[gpu_check] {mark:8s} {check.name} ({check.seconds:.0f} s) {check.detail}",
              flush=True)
        return check

    def need(self, name: str, gpus: int) -> bool:
        """Record ``name`` as needing ``gpus`` GPUs when the machine has fewer."""
        if self.gpus >= gpus:
            return True
        self.checks.append(Check(name, f"needs {gpus} GPUs",
                                 detail=f"this machine has {self.gpus}"))
        print(f"[gpu_check] NEEDS {gpus} GPUs  {name}", flush=True)
        return False

    # ------------------------------------------------------------------ the checks
    def machine(self) -> None:
        """``python -m hadpsgd.comm`` on one rank: the MPI library, CUDA-awareness, NCCL."""
        start = time.monotonic()
        code, out = self.sh(self.mpirun(1, ["-m", "hadpsgd.comm"]), 120)
        check = Check("machine check (python -m hadpsgd.comm)",
                      "pass" if code == 0 else "fail", detail=f"exit {code}")
        check.lines = [x for x in out.splitlines() if x.strip()][-30:]
        self.record(check, start)

    def pytest(self) -> None:
        """``pytest tests/gpu`` with a line per test from its JUnit record."""
        start = time.monotonic()
        xml = self.work / "gpu-tests.xml"
        workers = ["-n", str(min(4, max(1, (os.cpu_count() or 2) // 4)))]
        if not _has_module("xdist"):
            workers = []
        code, out = self.sh([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA",
                             "-p", "no:cacheprovider", "--timeout", "240", *workers,
                             f"--junitxml={xml}"], 300)
        counts = {"pass": 0, "fail": 0, "skipped": 0}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"tests/gpu {case.get('name')}"
                if case.find("failure") is not None or case.find("error") is not None:
                    node = case.find("failure")
                    node = node if node is not None else case.find("error")
                    text = (node.get("message") or "") + "\n" + (node.text or "")
                    c = Check(name, "fail", detail=(node.get("message") or "")[:200])
                    c.lines = text.splitlines()[-40:]
                    counts["fail"] += 1
                elif case.find("skipped") is not None:
                    why = case.find("skipped").get("message") or ""  # type: ignore[union-attr]
                    status = "needs 2 GPUs" if "2 GPUs" in why else "skipped"
                    c = Check(name, status, detail=why[:200])
                    counts["skipped"] += 1
                else:
                    c = Check(name, "pass")
                    counts["pass"] += 1
                c.seconds = round(float(case.get("time") or 0), 1)
                self.checks.append(c)
        summary = Check("pytest tests/gpu", "pass" if code == 0 else "fail",
                        detail=f"exit {code}: {counts}")
        if code != 0 and not xml.exists():
            summary.lines = out.splitlines()[-60:]
        self.record(summary, start)

    def train(self, name: str, nprocs: int, args: list[str], steps: int,
              resume: bool = True, preset: str = "small", timeout: float = 150,
              log_every: int = 20) -> None:
        """One algorithm through ``python -m hadpsgd.run --device cuda``, resumed half-way."""
        start = time.monotonic()
        out_dir = self.work / name.replace(" ", "_").replace("/", "_")
        base = ["-m", "hadpsgd.run", "--device", "cuda", "--preset", preset, "--no-progress",
                "--out-dir", str(out_dir), "--log-every", str(log_every), *args]
        first = steps // 2 if resume else steps
        code, out = self.sh(self.mpirun(nprocs, [*base, "--max-steps", str(first)]), timeout)
        text = out
        if code == 0 and resume:
            code, out2 = self.sh(self.mpirun(nprocs, [*base, "--max-steps", str(steps),
                                                      "--resume", "auto"]), timeout)
            text += out2
            if code == 0 and "resumed from" not in out2:
                code = -1
        check = Check(name, "pass" if code == 0 else "fail")
        check.lines = _unique([x for x in text.splitlines()
                               if x.startswith("[hadpsgd] comm")
                               or x.startswith("[hadpsgd] note") or WARNING_RE.search(x)])
        fps = [float(m) for m in re.findall(r"([0-9.]+) frames/s", text)]
        secs = _step_seconds(out_dir)
        if code == 0 and "contiguous chunk" in text:
            check.status = "fail"  # cuDNN copies the LSTM weights at every forward
            check.detail = "cuDNN warned: LSTM weights not in one contiguous chunk (copied)"
        elif code == 0:
            check.detail = (f"{steps} steps on {nprocs} ranks"
                            + (", resumed at step " + str(first) if resume else "")
                            + (f", {secs * 1e3:.1f} ms/step (median)" if secs else "")
                            + (f", {fps[-1]:.0f} frames/s" if fps else ""))
        else:
            check.detail = f"exit {code}"
            check.lines += text.splitlines()[-40:]
        self.record(check, start)

    def python(self, name: str, code_text: str, timeout: float = 120) -> None:
        """A single-process check written in Python: passes when it exits 0."""
        start = time.monotonic()
        code, out = self.sh([sys.executable, "-c", code_text], timeout)
        lines = [x for x in out.splitlines() if x.strip()]
        check = Check(name, "pass" if code == 0 else "fail",
                      detail=(lines[-1][:200] if lines else f"exit {code}"))
        check.lines = lines[-40:] if code != 0 else [x for x in lines if WARNING_RE.search(x)]
        self.record(check, start)

    def bench(self, name: str, cmd: list[str], json_out: Path, timeout: float) -> None:
        """A benchmark: passes when it exits 0; keeps its table."""
        start = time.monotonic()
        code, out = self.sh(cmd, timeout)
        check = Check(name, "pass" if code == 0 else "fail", detail=f"exit {code}")
        table = [x for x in out.splitlines() if "|" in x or x.startswith("[")]
        check.lines = table[-30:] if code == 0 else out.splitlines()[-40:]
        if json_out.exists():
            check.detail += f", record {json_out.name}"
        self.record(check, start)

    # ------------------------------------------------------------------ report
    def report(self, path: Path, header: list[str]) -> int:
        """Write the Markdown report and its JSON twin; 1 if a check failed."""
        failed = [c for c in self.checks if c.status == "fail"]
        lines = ["# hadpsgd GPU check", "", *header, "",
                 f"**{len(failed)} failed**, "
                 f"{sum(c.status == 'pass' for c in self.checks)} passed, "
                 f"{sum(c.status.startswith('needs') for c in self.checks)} need more GPUs, "
                 f"{sum(c.status == 'skipped' for c in self.checks)} skipped", "",
                 "| check | result | s | detail |", "|---|---|---|---|"]
        for c in self.checks:
            lines.append(f"| {c.name} | {c.status} | {c.seconds:.0f} | "
                         f"{c.detail.replace('|', '/')} |")
        for c in self.checks:
            if c.lines:
                lines += ["", f"## {c.name}", "", "```", *c.lines, "```"]
        path.write_text("\n".join(lines) + "\n")
        path.with_suffix(".json").write_text(json.dumps(
            {"header": header, "checks": [asdict(c) for c in self.checks]}, indent=1))
        print(f"[gpu_check] report: {path} ({len(failed)} failed)", flush=True)
        return 1 if failed else 0


def _unique(lines: list[str]) -> list[str]:
    """``lines`` without repeats, each kept once with ``(xN)`` when it came N > 1 times."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [f"{line} (x{n})" if n > 1 else line for line, n in counts.items()]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _step_seconds(out_dir: Path) -> float | None:
    """Median seconds per step from the train records of ``metrics.jsonl`` (frames/s based)."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return None
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    times = [r["time"] for r in recs if r.get("kind") == "train"]
    steps = [r["step"] for r in recs if r.get("kind") == "train"]
    rates = [(t1 - t0) / (s1 - s0) for t0, t1, s0, s1 in
             zip(times, times[1:], steps, steps[1:], strict=False) if s1 > s0]
    return sorted(rates)[len(rates) // 2] if rates else None


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


def main() -> int:
    """Run every check; write the report; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=str(ROOT / "gpu-check-report.md"))
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which the remaining checks are skipped")
    parser.add_argument("--only", default="", help="comma-separated check keys to run")
    opts = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no GPU present (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    gpus = torch.cuda.device_count()
    work = Path(opts.work or tempfile.mkdtemp(prefix="hadpsgd-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    run = Runner(work, gpus, opts.quick)
    header = [f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"- GPUs: {gpus} x {torch.cuda.get_device_name(0)}",
              f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
              f"{torch.backends.cudnn.version()}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}",
              f"- python {sys.executable}"]
    steps = 40 if opts.quick else 200
    n = max(2, gpus)  # ranks share the GPU when there is one
    adam = ["--algo", "bmuf", "--ranks-per-node", "1", "--optimizer", "adam", "--lr", "0.001",
            "--sync-period", "8"]
    plan: list[tuple[str, object]] = [
        ("machine", run.machine),
        ("nccl1", lambda: run.python("one-rank NCCL group through NCCLIntra", SINGLE_NCCL)),
        ("cudnn", lambda: run.python("no cuDNN weight copy with per-layer small and swb",
                                     CUDNN_WARN, timeout=180)),
        ("ssgd1", lambda: run.train("ssgd small 1 rank", 1, ["--algo", "ssgd"], steps)),
        ("ssgdn", lambda: run.train(f"ssgd small {n} ranks", n, ["--algo", "ssgd"], steps)),
        ("adpsgd", lambda: run.train("adpsgd small", n, [
            "--algo", "adpsgd", "--super-learner-size", "1"], steps)),
        ("hadpsgd", lambda: run.train("h-adpsgd small 2x2", 4, [
            "--algo", "adpsgd", "--super-learner-size", "2", "--ranks-per-node", "2"], steps)),
        ("bmuf", lambda: run.train("bmuf-adam small", n, adam, steps)),
        ("bmufo", lambda: run.train("bmuf-adam small overlap int8", n, [
            *adam, "--bmuf-overlap", "--wire", "int8"], steps)),
        ("swb1", lambda: run.train("ssgd swb 1 rank (per-layer LSTM)", 1, [
            "--algo", "ssgd", "--batch-size", "16"], 30, preset="swb", log_every=5)),
        ("swbs", lambda: run.train("ssgd swb 1 rank (stacked LSTM)", 1, [
            "--algo", "ssgd", "--batch-size", "16", "--lstm-layout", "stacked"], 30,
            preset="swb", log_every=5)),
        ("swbn", lambda: run.train(f"bmuf-adam swb {n} ranks", n, [
            *adam, "--batch-size", "16"], 30, preset="swb", log_every=5)),
        # Mixed precision (issue 27): bf16 and fp16 through the main command, bf16 on the
        # gradient wire, swb's step time at bf16 and with TF32, and the throughput rows of
        # fp32 against bf16 against DDP under the same autocast (one rank: no 2nd GPU needed).
        ("bf16", lambda: run.train("ssgd small 1 rank bf16", 1, [
            "--algo", "ssgd", "--precision", "bf16"], steps)),
        ("fp16", lambda: run.train("ssgd small 1 rank fp16", 1, [
            "--algo", "ssgd", "--precision", "fp16"], steps)),
        ("gwire", lambda: run.train(f"ssgd small {n} ranks bf16 + grad-wire bf16", n, [
            "--algo", "ssgd", "--precision", "bf16", "--grad-wire", "bf16"], steps)),
        ("bmuf16", lambda: run.train("bmuf-adam small fp16", n, [
            *adam, "--precision", "fp16"], steps)),
        ("swbbf16", lambda: run.train("ssgd swb 1 rank bf16 (per-layer LSTM)", 1, [
            "--algo", "ssgd", "--batch-size", "16", "--precision", "bf16"], 30, preset="swb",
            log_every=5)),
        ("swbtf32", lambda: run.train("ssgd swb 1 rank fp32 --tf32 (per-layer LSTM)", 1, [
            "--algo", "ssgd", "--batch-size", "16", "--tf32"], 30, preset="swb",
            log_every=5)),
        ("ttp", lambda: run.bench("train_throughput swb fp32 vs bf16 vs DDP autocast", [
            sys.executable, "benchmarks/train_throughput.py", "--device", "cuda",
            "--presets", "swb", "--ranks", "1", "--precision", "fp32", "bf16", "--steps",
            "20", "--warmup", "3", "--json", str(work / "ttp.json")], work / "ttp.json", 300)),
        ("pytest", run.pytest),
        ("comm", lambda: run.bench("benchmarks.comm --device cuda", [
            sys.executable, "-m", "benchmarks.comm", "-n", str(n), "--device", "cuda",
            "--op", "allreduce", "-b", "4K", "-e", "64M", "-f", "8",
            "--json", str(work / "comm.json")], work / "comm.json", 180)),
        ("tt", lambda: run.need("train_throughput vs DDP-NCCL", 2) and run.bench(
            "train_throughput vs DDP-NCCL", [
                sys.executable, "benchmarks/train_throughput.py", "--device", "cuda",
                "--presets", "small", "swb", "--ranks", "1", str(gpus), "--steps", "20",
                "--warmup", "3", "--json", str(work / "tt.json")], work / "tt.json", 300)),
        ("nccl", lambda: run.need("NCCL intra-node training (one rank per GPU)", 2)
         and run.train("ssgd small nccl", gpus, ["--algo", "ssgd", "--intra-backend",
                                                 "nccl"], steps)),
    ]
    only = set(opts.only.split(",")) if opts.only else None
    for key, fn in plan:
        if only is not None and key not in only:
            continue
        if time.monotonic() - t0 > opts.budget:
            run.checks.append(Check(key, "skipped", detail=f"past the {opts.budget:.0f} s "
                                                            "budget"))
            continue
        fn()  # type: ignore[operator]
    header.append(f"- total: {time.monotonic() - t0:.0f} s")
    code = run.report(Path(opts.report), header)
    for name in ("comm.json", "tt.json", "ttp.json"):
        if (work / name).exists():
            shutil.copy(work / name, Path(opts.report).parent / f"gpu-check-{name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
