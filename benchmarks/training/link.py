"""Every byte on the link: the main command on two emulated hosts, link counters beside the run's.

Each configuration runs ``python -m hadpsgd.run`` twice on two emulated hosts
(:class:`benchmarks._common.netns.TwoHosts`: two network namespaces, MPI over TCP through a
veth pair), at a short and a long ``--max-steps``. The bytes the pair's queues sent (both
directions, ``tc -s``) are read around each run, so the link's figure holds everything that
crossed: payload, ADPSGD's pairing and its data pool, control, start-up, evaluation. The
difference of the two runs, over the difference of their steps, is the link's bytes a step
(start-up and the end's evaluation cancel); the long run is the whole run. Beside them the
run's own count (its final ``metrics.jsonl`` record, summed over every rank), so a user sees
whether what hadpsgd reports is what the link carries. Ratios against SSGD fp32 measured in
the same invocation.

With ``--step-times`` every step is logged (``--log-every 1``) and the long run's steps on
rank 0 are timed: those that crossed the link (rank 0's inter-node bytes moved: BMUF's block
syncs, SSGD's every step, ADPSGD's gossip in its thread) and the control points (a tiny
allreduce of every rank every ``--control-every`` steps) against the same job's steps that
never communicate across it. A step after an epoch's end (its evaluation) is left out.
``--delay`` adds one-way latency: through ``tc netem`` where the kernel has it, else through
the user-space link of :mod:`benchmarks._common.slowlink`. Usage::

    python -m benchmarks.training.link [--configs ssgd bmuf-sign hadpsgd-topk] \
        [--steps 80 240] [--rate 1gbit] [--delay 50ms] [--step-times] [--json out.json] \
        [-- extra hadpsgd.run flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import ROOT, bench_env, emit, flag_value
from benchmarks._common.netns import TwoHosts
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start

CONFIGS: dict[str, list[str]] = {
    "ssgd": ["--algo", "ssgd"],
    "bmuf": ["--algo", "bmuf"],
    "bmuf-sign": ["--algo", "bmuf", "--wire", "sign"],
    "bmuf-signtopk": ["--algo", "bmuf", "--wire", "signtopk"],
    "hadpsgd": ["--algo", "adpsgd"],
    "hadpsgd-topk": ["--algo", "adpsgd", "--wire", "topk"],
    "adpsgd-topk": ["--algo", "adpsgd", "--wire", "topk", "--ranks-per-node", "1"],
}
"""The runs, by name: flags of ``hadpsgd.run``. Each host is a node (2 ranks a host), so
``hadpsgd*`` is H-ADPSGD of 2 super-learners x 2 and ``adpsgd-topk`` flat ADPSGD of 4 (two
pairs of them on each host, so some of its exchanges never reach the link)."""


def _counted(out_dir: Path) -> dict[str, float]:
    """The run's own count: its ``bytes`` record (every rank's together, and rank 0's).

    With it the ``step`` the run ended at (a run whose data ends first stops there).
    """
    for line in reversed((out_dir / "metrics.jsonl").read_text().splitlines()):
        record = json.loads(line)
        if record.get("kind") == "bytes":
            return {k: float(v) for k, v in record.items() if k.endswith("bytes")
                    or k.endswith("bytes_received") or k == "step"}
    return {}


def step_times(out_dir: Path, control_every: int = 10) -> dict[str, Any]:
    """Rank 0's step times of a run logged every step, those that communicated apart.

    A step communicated when rank 0's inter-node bytes (sent or received) or BMUF's block
    syncs moved in it, or it ended at a control point; it is quiet otherwise. The first step
    (its warm-up) and a step after an epoch's end (an evaluation ran between) are left out.

    Returns:
        ``quiet`` and ``communicating``: each ``{"steps", "mean_s", "median_s"}``; ``all``
        the same over both; ``overhead``: the mean step over the quiet mean, less one.
    """
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    keys = ("internode_bytes", "internode_bytes_received", "block_syncs")
    quiet: list[float] = []
    loud: list[float] = []
    for prev, cur in zip(train, train[1:], strict=False):
        if cur["step"] != prev["step"] + 1 or cur.get("epoch") != prev.get("epoch"):
            continue
        moved = any(cur.get(k, 0) != prev.get(k, 0) for k in keys)
        (loud if moved or cur["step"] % control_every == 0 else quiet).append(
            cur["time"] - prev["time"])

    def stats(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"steps": len(values),
                "mean_s": sum(values) / len(values) if values else 0.0,
                "median_s": ordered[len(ordered) // 2] if values else 0.0}

    out = {"quiet": stats(quiet), "communicating": stats(loud), "all": stats(quiet + loud)}
    base = out["quiet"]["mean_s"]
    out["overhead"] = out["all"]["mean_s"] / base - 1 if base > 0 else None
    return out


def run_one(hosts: TwoHosts, flags: list[str], steps: int, nprocs: int,
            timeout: float) -> dict[str, Any]:
    """One run of the main command: seconds, link bytes both ways, the run's own figures."""
    with tempfile.TemporaryDirectory(prefix="hadpsgd-link-") as tmp:
        # Epochs enough for --max-steps to end it, whatever the data's size.
        argv = [sys.executable, "-m", "hadpsgd.run", "--epochs", "1000", *flags,
                "--max-steps", str(steps), "--out-dir", tmp, "--no-progress"]
        env = {**bench_env(nprocs), "HADPSGD_TIMEOUT": "120"}
        for _ in range(LAUNCH_TRIES):  # the counters are read again with each start
            before = hosts.link_bytes()
            start = time.perf_counter()
            res = subprocess.run(hosts.mpirun(nprocs, argv), capture_output=True, text=True,
                                 timeout=timeout, env=env, cwd=ROOT)
            seconds = time.perf_counter() - start
            after = hosts.link_bytes()
            if res.returncode == 0 or not launcher_failed_to_start(res.stdout + res.stderr):
                break
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(flags)} --max-steps {steps} failed "
                             f"({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        lines = [s for s in res.stdout.splitlines() if "inter-node bytes" in s]
        counted = _counted(Path(tmp))
        if counted.get("step", steps) != steps:  # (a version without the record: unchecked)
            raise SystemExit(f"{' '.join(flags)} ended at step {counted.get('step')}, not "
                             f"{steps}: give it more data or --epochs")
        timed = (step_times(Path(tmp), int(flag_value(flags, "--control-every") or 10))
                 if flag_value(flags, "--log-every") == "1" else None)
        return {"steps": steps, "seconds": seconds,
                "link_bytes": sum(after) - sum(before),
                "link_bytes_each_way": [a - b for a, b in zip(after, before, strict=True)],
                "counted": counted, "last_line": lines[-1] if lines else "",
                "step_times": timed}



def measure(name: str, flags: list[str], hosts: TwoHosts, steps: tuple[int, int],
            nprocs: int, timeout: float) -> dict[str, Any]:
    """A configuration's row: per step from the two runs' difference, whole run from the long."""
    short, long = (run_one(hosts, flags, s, nprocs, timeout) for s in steps)
    span = long["steps"] - short["steps"]
    def both_ways(run: dict[str, Any]) -> float:
        # A byte between two ranks is one rank's "sent" and the other's "received": the
        # link carries it once, so the world's sent plus control is what crossed.
        # The start's broadcast of the model (said apart by the run) crossed too.
        c = run["counted"]
        return (c.get("world_internode_bytes", 0.0) + c.get("world_control_bytes", 0.0)
                + c.get("startup_bytes", 0.0))

    link_per_step = (long["link_bytes"] - short["link_bytes"]) / span
    counted_per_step = (both_ways(long) - both_ways(short)) / span
    return {"config": name, "flags": flags,
            "link_per_step": link_per_step,
            "link_whole_run": long["link_bytes"],
            "counted_per_step": counted_per_step,
            "counted_whole_run": both_ways(long),
            # What does not grow with the steps (start, closing averages, MPI's own start):
            # the whole run less its steps at the per-step rate.
            "link_fixed": long["link_bytes"] - long["steps"] * link_per_step,
            "counted_fixed": both_ways(long) - long["steps"] * counted_per_step,
            "counted_startup": long["counted"].get("startup_bytes", 0.0),
            "control_per_step": (long["counted"].get("world_control_bytes", 0.0)
                                 - short["counted"].get("world_control_bytes", 0.0)) / span,
            "counted": long["counted"], "runs": [short, long],
            "step_times": long["step_times"]}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's bytes against SSGD's (per step and whole run), link and counted."""
    ref = next((r for r in rows if r["config"] == "ssgd"), None)
    for r in rows:
        for key in ("link_per_step", "link_whole_run", "counted_per_step"):
            r[f"ssgd_over_{key}"] = (ref[key] / r[key] if ref is not None and r[key] > 0
                                     else None)
        r["link_over_counted"] = (r["link_per_step"] / r["counted_per_step"]
                                  if r["counted_per_step"] > 0 else None)


def ratio(x: float | None) -> str:
    """A ratio for the tables: ``-`` where none, ``1,075x`` from 10 on, ``1.94x`` below."""
    return "-" if x is None else f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x"


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """The driver's own arguments and, after ``--``, the flags passed on to ``hadpsgd.run``."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def table(rows: list[dict[str, Any]]) -> str:
    """The stdout table: one line per configuration."""
    lines = [f"{'config':<14} {'link B/step':>12} {'vs ssgd':>8} {'counted B/step':>15} "
             f"{'of it control':>13} {'link/counted':>12} {'link, run':>12} {'vs ssgd':>8} "
             f"{'link fixed':>11} {'counted fixed':>13}"]
    for r in rows:
        lines.append(f"{r['config']:<14} {r['link_per_step']:>12,.0f} "
                     f"{ratio(r['ssgd_over_link_per_step']):>8} "
                     f"{r['counted_per_step']:>15,.0f} {r['control_per_step']:>13,.0f} "
                     f"{ratio(r['link_over_counted']):>12} "
                     f"{r['link_whole_run']:>12,.0f} {ratio(r['ssgd_over_link_whole_run']):>8} "
                     f"{r.get('link_fixed', 0):>11,.0f} {r.get('counted_fixed', 0):>13,.0f}")
    return "\n".join(lines)


def step_table(rows: list[dict[str, Any]]) -> str:
    """The step times of each row that has them: quiet steps against communicating ones."""
    lines = [f"{'config':<14} {'quiet steps':>11} {'quiet ms':>9} {'comm steps':>10} "
             f"{'comm ms':>8} {'comm median':>11} {'every step ms':>13} {'vs quiet':>9}"]
    for r in rows:
        t = r.get("step_times")
        if not t:
            continue
        q, c, a = t["quiet"], t["communicating"], t["all"]
        over = "-" if t["overhead"] is None else f"{t['overhead']:+.0%}"
        lines.append(f"{r['config']:<14} {q['steps']:>11} {q['mean_s'] * 1e3:>9.1f} "
                     f"{c['steps']:>10} {c['mean_s'] * 1e3:>8.1f} {c['median_s'] * 1e3:>11.1f} "
                     f"{a['mean_s'] * 1e3:>13.1f} {over:>9}")
    return "\n".join(lines) if len(lines) > 1 else ""


def main(argv: list[str] | None = None) -> int:
    """Run every configuration on two emulated hosts; print the table and the JSON record."""
    argv, extra = split_extra(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["ssgd", "bmuf-sign", "hadpsgd-topk"],
                   choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, nargs=2, default=[80, 240], metavar=("SHORT", "LONG"))
    p.add_argument("--rate", default="1gbit", help="the link's rate each way (tc units)")
    p.add_argument("--delay", default=None,
                   help="one-way latency, e.g. 50ms (tc netem, else the user-space link)")
    p.add_argument("--step-times", action="store_true",
                   help="log every step and time rank 0's steps that cross the link against "
                        "those that do not")
    p.add_argument("--preset", default="small")
    p.add_argument("-n", "--ranks", type=int, default=4, help="ranks, half on each host")
    p.add_argument("--json", type=Path, help="also write the JSON record here")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    a = p.parse_args(argv)
    if a.steps[1] <= a.steps[0]:
        p.error("--steps SHORT LONG: LONG must be more than SHORT")
    rows = []
    with TwoHosts(rate=a.rate, delay=a.delay) as hosts:
        for name in a.configs:
            flags = [*CONFIGS[name], "--preset", a.preset, *extra]
            if a.step_times:
                flags += ["--log-every", "1"]
            rows.append(measure(name, flags, hosts, (a.steps[0], a.steps[1]), a.ranks,
                                a.timeout))
            print(f"# {name}: {rows[-1]['runs'][1]['last_line']}", flush=True)
    add_ratios(rows)
    print(f"{a.ranks} ranks on two emulated hosts ({a.rate}"
          f"{', ' + a.delay + ' each way' if a.delay else ''}"
          f"{', the user-space link' if hosts.userspace else ''}), --preset {a.preset}, "
          f"runs of {a.steps[0]} and {a.steps[1]} steps {' '.join(extra)}")
    print(table(rows))
    if a.step_times:
        print(step_table(rows))
    emit({"benchmark": "link", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "cpus": os.cpu_count(), "rate": a.rate, "delay": a.delay, "steps": a.steps,
          "link": hosts.link,
          "extra": extra, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
