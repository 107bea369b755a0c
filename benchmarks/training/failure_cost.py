"""What a failure costs under ``--on-failure continue``, and the step when nothing fails.

The seconds from a lost learner to the next trained step, and the step's time without a
failure. Every run goes through ``python -m hadpsgd.launch`` (the path a user takes) on a
synthetic set and ``--preset tiny``; three parts, one invocation, so that their ratios share
the machine's load:

- **overhead**: SSGD on ``--nprocs`` learners in three modes, alternated pair by pair (the
  order swapped every pair): ``plain`` (no ``--on-failure``), ``continue`` (``--on-failure
  continue``: ULFM, a snapshot at every control point, the heartbeat detector off, the
  default) and ``continue + detector`` (``HADPSGD_FT_DETECTOR=1``). A run's speed is the
  median of its steady ``train`` windows (:mod:`benchmarks.training.steady`); the ratio is a
  mode's seconds per step over ``plain``'s of the same pair, and the median of the pairs.
- **kill**: for every algorithm (SSGD, BMUF on super-learners of 2, ADPSGD, H-ADPSGD on
  super-learners of 2) at 4 and 8 learners, the last learner SIGKILLs itself at step
  ``--fault-step`` (``HADPSGD_FAULT=kind=kill``), and rank 0 (the run directory's writer and
  ADPSGD's pool host) at 4 learners: the seconds from the fault's line (its ``t=``) to the
  first ``train`` record after the ``failure`` record (``--log-every 1``: rank 0's next
  completed step), and the record's ``recovery_s`` (revoke, shrink, rebuild, adopt).
- **frozen**: a learner SIGSTOPs itself (``kind=stop``) under SSGD and ADPSGD, with the
  detector and without it (then it is found at the deadline, ``--deadline`` s): the same
  seconds to the next trained step.

Usage::

    python -m benchmarks.training.failure_cost [--nprocs 4] [--pairs 3] [--deadline 20]
        [--only overhead,kill,frozen] [--json failure-cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import ROOT, bench_env
from benchmarks.training.steady import read_steady

ALGOS: dict[str, list[str]] = {
    "ssgd": ["--algo", "ssgd"],
    "bmuf": ["--algo", "bmuf", "--ranks-per-node", "2", "--sync-period", "4"],
    "adpsgd": ["--algo", "adpsgd", "--super-learner-size", "1"],
    "h-adpsgd": ["--algo", "adpsgd", "--super-learner-size", "2"],
}
"""The algorithms of the kill part, as the soak runs them."""

MODES: dict[str, tuple[list[str], dict[str, str]]] = {
    "plain": ([], {}),
    "continue": (["--on-failure", "continue"], {}),
    "continue + detector": (["--on-failure", "continue"], {"HADPSGD_FT_DETECTOR": "1"}),
}
"""The overhead part's modes: extra flags and environment of each."""

CRASH = "Segmentation fault"  # Open MPI's detector now and then crashes MPI_Init (failures.md)


def session_pids(session: int) -> list[int]:
    """The processes of ``session`` (a job started with ``start_new_session``), from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rpartition(")")[2].split()[3]) == session:
                    pids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return pids


def launch(data: tuple[Path, Path], out: Path, nprocs: int, args: Sequence[str],
           env: dict[str, str], timeout: float) -> tuple[int | None, str, float]:
    """One job through ``python -m hadpsgd.launch``.

    Returns:
        The exit code (None at the timeout), the output and the wall seconds. A process left
        over (a frozen learner) is killed after the job.
    """
    cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), "--",
           "--train", str(data[0]), "--heldout", str(data[1]), "--out-dir", str(out),
           "--no-progress", "--preset", "tiny", "--batch-size", "4", "--epochs", "100",
           "--checkpoint-every", "0", *args]  # a later --preset in args wins (argparse)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=bench_env(nprocs, env), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, code = proc.communicate()[0], None
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, output, time.monotonic() - start


def launch_retried(data: tuple[Path, Path], out: Path, nprocs: int, args: Sequence[str],
                   env: dict[str, str], timeout: float) -> tuple[int | None, str, float, int]:
    """:func:`launch`, again where a rank crashed in ``MPI_Init`` before anything trained.

    Open MPI's heartbeat detector now and then crashes a launch in ``MPI_Init``
    (docs/failures.md); up to 3 tries. Returns the last one's figures and the retries.
    """
    tries = 0
    for tries in range(3):  # noqa: B007 (returned)
        if out.exists():
            for item in sorted(out.rglob("*"), reverse=True):
                item.rmdir() if item.is_dir() else item.unlink()
        code, output, wall = launch(data, out, nprocs, args, env, timeout)
        if CRASH not in output or (out / "metrics.jsonl").exists():
            break
    return code, output, wall, tries


def records(out: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` records."""
    path = out / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def overhead(data: tuple[Path, Path], tmp: Path, nprocs: int, pairs: int, steps: int,
             deadline: int, timeout: float, preset: str = "tiny") -> dict[str, Any]:
    """The overhead part: every mode ``pairs`` times, alternated (model ``preset``)."""
    runs: list[dict[str, Any]] = []
    for pair in range(pairs):
        for mode in (list(MODES) if pair % 2 == 0 else list(reversed(MODES))):
            flags, extra = MODES[mode]
            out = tmp / f"overhead-{pair}-{mode.replace(' ', '').replace('+', '-')}"
            code, output, wall, tries = launch_retried(
                data, out, nprocs, ["--algo", "ssgd", "--max-steps", str(steps),
                                    "--log-every", "20", "--preset", preset, *flags],
                {"HADPSGD_TIMEOUT": str(deadline), **extra}, timeout)
            steady = read_steady(out / "metrics.jsonl") if code == 0 else None
            if steady is None or steady.sec_per_step is None:
                raise SystemExit(f"overhead {mode}: exit {code}, no steady speed\n"
                                 f"{output[-3000:]}")
            runs.append({"pair": pair, "mode": mode, "sec_per_step": steady.sec_per_step,
                         "frames_per_s": steady.frames_per_s, "windows": steady.windows,
                         "wall_s": round(wall, 2), "launch_retries": tries})
            print(json.dumps(runs[-1]), flush=True)
    ratios = {mode: [next(r for r in runs if r["pair"] == p and r["mode"] == mode)
                     ["sec_per_step"] / next(r for r in runs if r["pair"] == p
                                             and r["mode"] == "plain")["sec_per_step"]
                     for p in range(pairs)] for mode in MODES}
    return {"nprocs": nprocs, "pairs": pairs, "max_steps": steps, "preset": preset, "runs": runs,
            "median_sec_per_step": {m: statistics.median(r["sec_per_step"] for r in runs
                                                         if r["mode"] == m) for m in MODES},
            "ratios": ratios, "median_ratio": {m: statistics.median(v)
                                               for m, v in ratios.items()}}


def to_next_step(data: tuple[Path, Path], out: Path, case: dict[str, Any], deadline: int,
                 timeout: float) -> dict[str, Any]:
    """One kill or freeze: the seconds from the fault to the next trained step."""
    fault = f"kind={case['kind']},rank={case['rank']},step={case['step']}"
    extra = {"HADPSGD_TIMEOUT": str(deadline), "HADPSGD_FAULT": fault}
    if case.get("detector"):
        extra["HADPSGD_FT_DETECTOR"] = "1"
    args = [*ALGOS[case["algo"]], "--on-failure", "continue", "--log-every", "1",
            "--max-steps", str(case["steps"])]
    code, output, wall, tries = launch_retried(data, out, case["nprocs"], args, extra, timeout)
    row = {**case, "exit": code, "wall_s": round(wall, 2), "launch_retries": tries}
    found = next_step(output, records(out))
    if code != 0 or isinstance(found, str):
        return {**row, "problem": f"exit {code}, {found if isinstance(found, str) else 'ok'}: "
                                  f"{output[-1500:]}"}
    return {**row, **found}


def next_step(output: str, recs: Sequence[dict[str, Any]]) -> dict[str, Any] | str:
    """From a job's output and records: what the failure cost rank 0's training, or why not.

    The fault's time is its line's ``t=`` (printed by the learner as it fails); rank 0
    writes a ``train`` record a step under ``--log-every 1`` and the ``failure`` record when
    the recovery is done, each with the clock time it wrote it. Figures:

    - ``detected_s``: fault -> the ``failure`` record (found, revoked, shrunk, rebuilt,
      adopted);
    - ``stall_s``: the longest pause of rank 0's training from the fault to the first step
      after the recovery (or to the recovery, where the run ended with it). SSGD and BMUF
      stop at their next collective until the recovery is done; ADPSGD's survivors train on
      (a dead learner is a straggler nobody waits for) and meet it at their next meeting;
    - ``to_next_step_s``: fault -> the first step after the ``failure`` record (None where
      the run ended with the recovery: ADPSGD found it at its last meeting).
    """
    fired = re.search(r"fault injection: .* t=([\d.]+)", output)
    fail = next((i for i, r in enumerate(recs) if r["kind"] == "failure"), None)
    if not fired or fail is None:
        return f"fault {'fired' if fired else 'not fired'}, " \
               f"{'a' if fail is not None else 'no'} failure record"
    t0 = float(fired[1])
    after = next((r for r in recs[fail + 1:] if r["kind"] == "train"), None)
    times = [t0, *(r["time"] for r in recs[:fail] if r["kind"] == "train" and r["time"] > t0),
             recs[fail]["time"], *([after["time"]] if after else [])]
    return {"detected_s": round(recs[fail]["time"] - t0, 3),
            "stall_s": round(max(b - a for a, b in zip(times, times[1:], strict=False)), 3),
            "to_next_step_s": round(after["time"] - t0, 3) if after else None,
            "recovery_s": recs[fail]["recovery_s"], "learners_after": recs[fail]["learners"],
            "failure_step": recs[fail]["step"], "next_step": after["step"] if after else None}


POOLED = ("adpsgd", "h-adpsgd")


def run_steps(algo: str, step: int, nprocs: int) -> int:
    """A case's ``--max-steps``: twice the fault's step; under ADPSGD ``nprocs`` times that.

    ADPSGD's steps are the pool's, every learner's counted (``--max-steps`` and the
    records'), while a fault's step is the learner's own: its 10th step of 4 is the pool's
    ~40th, and a run of 20 would end before the fault.
    """
    return 2 * step * (nprocs if algo in POOLED else 1)


def cases(parts: set[str], step: int) -> list[dict[str, Any]]:
    """The kill and freeze cases of ``parts``."""
    out: list[dict[str, Any]] = []
    if "kill" in parts:
        for n in (4, 8):
            out += [{"part": "kill", "kind": "kill", "algo": a, "nprocs": n, "rank": n - 1,
                     "step": step, "steps": run_steps(a, step, n)} for a in ALGOS]
        out += [{"part": "kill", "kind": "kill", "algo": a, "nprocs": 4, "rank": 0,
                 "step": step, "steps": run_steps(a, step, 4)} for a in ALGOS]
    if "frozen" in parts:
        out += [{"part": "frozen", "kind": "stop", "algo": a, "nprocs": 4, "rank": 3,
                 "step": step, "steps": run_steps(a, step, 4), "detector": det}
                for a in ("ssgd", "adpsgd") for det in (False, True)]
    return out


def tables(result: dict[str, Any]) -> str:
    """Markdown tables of the parts that ran."""
    rows: list[str] = []
    if "overhead" in result:
        ov = result["overhead"]
        rows += ["| mode (SSGD, no failure) | sec/step (median of runs) | ratio to plain "
                 "(median of pairs) | per pair |", "|---|---|---|---|"]
        for mode in MODES:
            rows.append(f"| {mode} | {ov['median_sec_per_step'][mode] * 1e3:.2f} ms | "
                        f"{ov['median_ratio'][mode]:.3f} | "
                        f"{', '.join(f'{x:.3f}' for x in ov['ratios'][mode])} |")
        rows.append("")
    if result.get("cases"):
        rows += ["| failure | algorithm | learners | rank | detector | longest pause of "
                 "training | fault -> next step | fault -> recovered | recovery | learners "
                 "after |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in result["cases"]:
            what = "SIGKILL" if c["kind"] == "kill" else "SIGSTOP"
            det = "on" if c.get("detector") else "off"
            if "problem" in c:
                rows.append(f"| {what} | {c['algo']} | {c['nprocs']} | {c['rank']} | {det} | "
                            f"failed: exit {c['exit']} | | | | |")
                continue
            nxt = "run ended" if c["to_next_step_s"] is None else f"{c['to_next_step_s']:.2f} s"
            rows.append(f"| {what} | {c['algo']} | {c['nprocs']} | {c['rank']} | {det} | "
                        f"{c['stall_s']:.2f} s | {nxt} | {c['detected_s']:.2f} s | "
                        f"{c['recovery_s']:.2f} s | {c['learners_after']} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the parts, print the tables, write the JSON; exit 1 if a case failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training.failure_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4, help="learners of the overhead runs")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each overhead mode")
    parser.add_argument("--steps", type=int, default=200, help="steps of an overhead run")
    parser.add_argument("--preset", default="tiny",
                        help="model of the overhead runs (a larger step is less noisy)")
    parser.add_argument("--fault-step", type=int, default=20,
                        help="the step a kill or freeze fires at (the run takes twice that)")
    parser.add_argument("--deadline", type=int, default=20, help="HADPSGD_TIMEOUT of every run")
    parser.add_argument("--only", default="overhead,kill,frozen", help="parts to run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    opts = parser.parse_args(argv)
    parts = set(opts.only.split(","))
    from hadpsgd.data.synth import SynthSpec, generate

    result: dict[str, Any] = {"command": " ".join(["python -m benchmarks.training.failure_cost",
                                                   *(argv or sys.argv[1:])]),
                              "deadline_s": opts.deadline}
    with tempfile.TemporaryDirectory(prefix="hadpsgd-failure-cost-") as tmp:
        data = generate(Path(tmp) / "data", SynthSpec(
            feat_dim=260, num_classes=12, train_utts=600, heldout_utts=12, min_len=60,
            max_len=120, seed=3))
        if "overhead" in parts:
            result["overhead"] = overhead(data, Path(tmp), opts.nprocs, opts.pairs,
                                          opts.steps, opts.deadline, opts.timeout,
                                          opts.preset)
        result["cases"] = []
        for i, case in enumerate(cases(parts, opts.fault_step)):
            result["cases"].append(to_next_step(data, Path(tmp) / f"case-{i}", case,
                                                opts.deadline, opts.timeout))
            print(json.dumps(result["cases"][-1])[:600], flush=True)
    print(tables(result))
    if opts.json is not None:
        opts.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any("problem" in c for c in result["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
