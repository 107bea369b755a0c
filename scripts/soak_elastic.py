"""Elastic soak through ``python -m hadpsgd.launch -- --on-failure continue``: every phase.

Failures at every phase of a run, and resumes at another size.

Every round picks an algorithm (SSGD, BMUF on super-learners of 2 with ``--sync-period 4``,
flat ADPSGD, H-ADPSGD on super-learners of 2), a world of 4 to 8 learners (even where
super-learners are of 2) and a failure, then checks the outcome the failure must have:

- ``kill``: SIGKILL of one learner (``HADPSGD_FAULT`` kind=kill; rank 0 included: it writes
  the run directory and hosts ADPSGD's pool) at a random step;
- ``kill-sync``: the same at a BMUF block sync (a step that is a multiple of
  ``--sync-period``);
- ``kill-control``: at a control point (a multiple of ``--control-every``: SSGD's and BMUF's
  snapshots, ADPSGD's pool meetings);
- ``kill-ckpt``: inside a checkpoint write (``at=ckpt-data|ckpt-manifest|ckpt-rename`` on
  rank 0, the writer; ``at=ckpt-wait`` on another rank while rank 0 writes; ``at=ckpt-part``
  on a BMUF node leader writing its node's part);
- ``kill-eval``: a real ``os.kill(SIGKILL)`` of a rank's process as the first epoch of a
  two-epoch run ends (its last step, the held-out evaluation, the epoch's checkpoint);
- ``recovery``: a second learner SIGKILLed (its process, ``os.kill``) 0 to 0.4 s after the
  first one's fault fired, while the survivors recover;
- ``stop``: a real ``os.kill(SIGSTOP)`` of a rank's process at a random moment of training
  (the heartbeat detector must drop it);
- ``raise``: a learner's own exception (kind=raise): every rank must end within seconds with
  exit 1 and one line naming it, no ``failure`` record;
- ``startup``: a learner frozen, hung or killed in start-up (``at=startup-mpi|startup-data|
  startup-model``): exit 1 or 3 within the deadline, naming the rank;
- ``min-learners``: two learners killed at one step under ``--min-learners`` above what
  survives: exit 1, a ``failure`` record that says it stopped, and a checkpoint of the
  survivors' world at that record's step.

- ``stop-sync`` (round 3): a learner frozen (``HADPSGD_FAULT`` kind=stop) at a BMUF block
  sync on a compressed wire (int4, sign, topk): found by the host's sentinel
  (``HADPSGD_FROZEN_S=5``), or with it off (``0``) at the channel's deadline, asked on the
  main control communicator and killed there; the others go on (exit 0);
- ``script`` (round 3): the launcher's script mode runs a user's script (a small model under
  ``hadpsgd.Distributed``: SSGD, BMUF or ADPSGD) in which one rank deadlocks in its own code
  (exit 3, the line names it), calls ``sys.exit(7)`` (exit 7) or ``sys.exit(0)`` (exit 0),
  raises (exit 1) or does nothing (exit 0): ``_soak_round3.py``;
- ``extend`` (round 3): a BMUF run ended by its epoch or by ``--max-steps`` mid-block, then
  extended with ``--resume auto --epochs 2``, must end with the same tensors as the
  uninterrupted two-epoch run.

Every round draws a wire for BMUF's block sync (fp32, int4, sign, topk) or ADPSGD's gossip
(fp32, int8, CHOCO's topk). For BMUF the chunk accounting takes the global model's step of
each failure (the record's ``model_step``): the block in flight must be trained again by
the survivors, so a block silently dropped shows as a leaver's chunks never trained again.

Expected for the kills and the stop: exit 0, ``failure`` records naming exactly the lost
learners, each at the right step (SSGD, BMUF: the control point the survivors went on from,
the last one before the fault's step; ADPSGD: the step the log line names), a last
checkpoint that verifies and records the survivors' world, and every chunk of the epoch
trained exactly once (the chunk trace; ADPSGD: the dead learner's chunks again by the
survivors) but for less than a global batch at its end.

Some rounds (``--resume-every``) are first stopped mid-epoch (``--max-steps``, or the
min-learners stop) and then resumed at another ``-np`` with ``--resume auto
--allow-resume-change np``: over both runs each chunk of the interrupted epoch is trained
once, and every learner's steps after the resume go on past the checkpoint's, forward only.

Every job runs under an outer timeout (``HADPSGD_TIMEOUT`` plus a margin): a job still there
then is killed and counted as a hang.

    python scripts/soak_elastic.py --rounds 100 [--seed 0] [--until HH:MM] [--json soak.json]
    python scripts/soak_elastic.py --recheck --json soak.json   # count a saved soak again

Prints a line per round and a summary (rounds, hangs, wrong exit codes, chunks twice or
lost, failure records at a wrong step, jobs that crashed); exit 1 if any round failed. Not
part of the test suite (too long for CI); ``tests/mpi/test_elastic.py`` holds one
deterministic case per algorithm and failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _soak_round3 import (  # noqa: E402 - beside this script
    SCRIPT_ALGOS,
    SCRIPT_CASES,
    STEPS,
    check_script,
    compare_final,
    write_script,
)

from hadpsgd.data import ChunkDataset  # noqa: E402
from hadpsgd.data.synth import SynthSpec, generate  # noqa: E402
from hadpsgd.launch import launch_env  # noqa: E402
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start  # noqa: E402
from hadpsgd.train import latest_checkpoint  # noqa: E402
from hadpsgd.train.checkpoint import CheckpointError, read_manifest, verify_checkpoint  # noqa: E402

BATCH = 2
CONTROL = 5
SYNC = 4
DEADLINE = 20  # HADPSGD_TIMEOUT
ALGOS: dict[str, list[str]] = {
    "ssgd": ["--algo", "ssgd"],
    "bmuf": ["--algo", "bmuf", "--ranks-per-node", "2", "--sync-period", str(SYNC)],
    "adpsgd": ["--algo", "adpsgd", "--super-learner-size", "1"],
    "h-adpsgd": ["--algo", "adpsgd", "--super-learner-size", "2"],
}
PAIRS = ("bmuf", "h-adpsgd")
POOLED = ("adpsgd", "h-adpsgd")
KINDS = {"kill": 3, "kill-sync": 1, "kill-control": 2, "kill-ckpt": 2, "kill-eval": 1,
         "recovery": 2, "stop": 2, "raise": 1, "startup": 1, "min-learners": 1,
         "stop-sync": 2, "script": 2, "extend": 1}
WIRES: dict[str, list[str]] = {
    "bmuf": ["fp32", "int4", "sign", "topk"],  # the block sync's (topk: with error feedback)
    "adpsgd": ["fp32", "int8", "topk"],  # topk: CHOCO's compressed gossip
    "h-adpsgd": ["fp32", "int8", "topk"],
}
"""The wires a round draws from (round 3: every wire among the rounds), the first the
default; ``stop-sync`` rounds draw a compressed one."""


@dataclass
class Job:
    """One launch's outcome."""

    code: int | None  # None: still running at its timeout (a hang)
    output: str
    wall_s: float
    fault_t: float | None = None  # when the first injected fault fired (unix time)
    killed: list[int] = field(default_factory=list)  # launch ranks the soak killed itself
    signal_t: float | None = None  # when the soak's own signal went
    landed: str = ""  # recovery rounds: where the second kill landed
    start_retries: int = 0  # launches retried: mpirun's own start-up failure, no rank ran


def rank_pids(session: int) -> dict[int, int]:
    """Launch rank -> pid of the job's rank processes (its session's, found in ``/proc``)."""
    pids: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[3]) != session:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for item in environ:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                pids[int(item.split(b"=", 1)[1])] = int(entry.name)
    return pids


def trace_chunks(out: Path, epoch: int) -> int:
    """How many chunks of ``epoch`` the trace holds so far (every rank's lines)."""
    n = 0
    for path in (out / "trace").glob("chunks-rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            n += len(rec["chunks"]) if rec["epoch"] == epoch else 0
    return n


def launch(nprocs: int, args: list[str], out: Path, data: tuple[Path, Path], fault: str,
           timeout: float, act: Any = None, env: dict[str, str] | None = None,
           script: list[str] | None = None) -> Job:
    """One job through the launcher, started again where mpirun itself failed to start.

    Open MPI's launcher now and then fails to bring up its PMIx server before any rank
    exists (exit 213; :func:`hadpsgd.launch.mpirun.launcher_failed_to_start`): nothing of the
    round ran.
    """
    for tries in range(LAUNCH_TRIES):
        job = launch_once(nprocs, args, out, data, fault, timeout, act, env, script)
        job.start_retries = tries
        if not launcher_failed_to_start(job.output):
            break
    return job


def launch_once(nprocs: int, args: list[str], out: Path, data: tuple[Path, Path], fault: str,
                timeout: float, act: Any = None, env_extra: dict[str, str] | None = None,
                script: list[str] | None = None) -> Job:
    """One job through the launcher: of ``hadpsgd.run``, or of ``script``.

    ``script`` is a path and its arguments: the launcher's script mode.

    ``act(job, proc, out, log)`` is polled while it runs: it sends the soak's own signals
    and returns True once it is done.
    """
    env = launch_env(nprocs=nprocs)
    env.update({"HADPSGD_TIMEOUT": str(DEADLINE), "HADPSGD_FAULT": fault,
                "HADPSGD_TRACE_CHUNKS": str(out / "trace"),
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), "--",
           "--train", str(data[0]), "--heldout", str(data[1]), "--preset", "tiny",
           "--out-dir", str(out), "--no-progress", "--batch-size", str(BATCH),
           "--on-failure", "continue", "--control-every", str(CONTROL), *args]
    if script is not None:
        cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), *script]
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    start = time.monotonic()
    job = Job(None, "", 0.0)
    offset = log.stat().st_size if log.exists() else 0  # this launch's output only
    with open(log, "a") as sink:
        sink.write(f"$ HADPSGD_FAULT='{fault}' {' '.join(cmd)}\n")
        sink.flush()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT, start_new_session=True)
        done = act is None
        while proc.poll() is None and time.monotonic() - start < timeout:
            if not done:
                done = act(job, proc, out, log)
            time.sleep(0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # a hang: mpirun and every rank under it
            proc.wait()
        else:
            job.code = proc.returncode
        # A rank left over (a SIGSTOPped one nobody killed) would keep its session.
        for pid in rank_pids(proc.pid).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    job.wall_s = time.monotonic() - start
    with open(log, "rb") as written:
        written.seek(offset)
        job.output = written.read().decode(errors="replace").replace("\0", "")
    job.fault_t = fault_time(job.output)
    return job


def fault_time(output: str) -> float | None:
    """When the first injected fault fired (its line's ``t=``), or None."""
    found = re.search(r"fault injection: .* t=([\d.]+)", output)
    return float(found[1]) if found else None


CRASH = "Segmentation fault"


def crash_line(output: str) -> str:
    """Where the first rank that crashed was (Open MPI's backtrace, its first frames)."""
    lines = [ln for ln in output.replace("\0", "").splitlines() if "NBC_Progress" not in ln]
    at = next(i for i, ln in enumerate(lines) if CRASH in ln)
    frames = [ln.split("] ", 1)[-1] for ln in lines[at:at + 40] if re.search(r"\] \[ ?\d+\]", ln)]
    return f"a rank crashed (SIGSEGV) at {'; '.join(frames[:6]) or 'an unmapped address'}"


def signal_rank(job: Job, proc: subprocess.Popen, rank: int, sig: int) -> bool:
    """Send ``sig`` to launch rank ``rank`` of the job; whether it went."""
    pid = rank_pids(proc.pid).get(rank)
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    job.killed.append(rank)
    job.signal_t = time.time()
    return True


def records(out: Path, kind: str) -> list[dict[str, Any]]:
    """The ``metrics.jsonl`` records of ``kind``."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def trace_lines(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Launch rank -> its chunk-trace records, in order."""
    return {int(p.stem.removeprefix("chunks-rank")): list(map(json.loads,
                                                             p.read_text().splitlines()))
            for p in (out / "trace").glob("chunks-rank*.jsonl")}


def chunks_kept(algo: str, lines: dict[int, list[dict[str, Any]]], gone: dict[int, int],
                upto: int | None = None) -> tuple[Counter, set[int]]:
    """The epoch-0 chunks in the final model (a count each), and the leavers' chunks lost.

    ``gone``: launch rank -> the step its state was kept up to: SSGD, BMUF: the control point
    the survivors went on from, for the dead learner and the rest of its super-learner (by
    the shards' step); ADPSGD: the last meeting of the pool before the failure (a checkpoint,
    the epoch's end; by the global step a slot was trained at), whose slots are the
    learners' (gossip carried them), the later ones of a leaver going back to the pool.
    ``upto``: the checkpoint a resume went on from; a
    step of the shards past it is in no model (SSGD, BMUF).
    """
    alive: Counter = Counter()
    lost: set[int] = set()
    for rank, recs in lines.items():
        # A pooled learner that lived into the next epoch left its epoch-0 slots trained
        # (SSGD's and BMUF's data goes back to the failure's model step, maybe in epoch 0).
        later = algo in POOLED and any(rec["epoch"] > 0 for rec in recs)
        steps: dict[int, list[int]] = {}
        for rec in recs:
            if rec["epoch"] != 0:
                continue
            if algo in POOLED:  # by the global step it was trained at (a meeting's count)
                steps[rec["global_step"] * 10**6 + len(steps)] = rec["chunks"]
            else:
                steps[rec["step"]] = rec["chunks"]  # a step retrained replaces its record
        for key, chunks in steps.items():
            step = key // 10**6 if algo in POOLED else key
            if algo not in POOLED and upto is not None and step > upto:
                continue
            if rank in gone and not later and step > gone[rank]:
                lost.update(chunks)
            else:
                alive.update(chunks)
    return alive, lost


def kept_steps(plan: Plan, out: Path) -> dict[int, int]:
    """Launch rank of each leaver -> the step its state was kept up to (:func:`chunks_kept`).

    SSGD, BMUF: the control point of the failure that lost it. ADPSGD: the pool's last
    meeting before that failure: a checkpoint's, or an earlier failure's recovery, where the
    survivors pooled what each had trained (a learner lost in a second failure keeps the
    slots it trained before the first one, as at any meeting).
    """
    kept: dict[int, int] = {}
    fails = records(out, "failure")
    for i, fail in enumerate(fails):
        if plan.algo in POOLED:
            step = max(plan.meeting, fails[i - 1]["step"] if i else 0)
        else:
            # BMUF mid-block: the global model (and the survivors' data) went back to the
            # last block sync; a leaver's chunks after it are in no model (issue 55 item 4).
            step = fail.get("model_step", fail["step"])
        for rank in leavers(plan.algo, fail["lost"]):
            kept.setdefault(rank, step)
    return kept


def chunk_problem(alive: Counter, lost: set[int], total: int, global_batch: int) -> str | None:
    """What is wrong with the epoch's chunk counts, or None."""
    twice = [c for c, n in alive.items() if n > 1]
    if twice:
        return f"{len(twice)} chunks trained twice"
    if not lost <= set(alive) and total - len(alive) >= global_batch:
        return f"{len(lost - set(alive))} of the lost learners' chunks never trained again"
    if total - len(alive) >= 2 * global_batch:
        return f"{total - len(alive)} of {total} chunks never trained"
    return None


def epoch_end_batch(plan: Plan, out: Path) -> int:
    """The global batch that ended epoch 0: what may be left over of its chunks.

    The survivors' where a failure came in epoch 0; the starting world's where every
    failure came after it (a recovery round's two-epoch run can lose its learners in epoch
    1: round 96 of seed 13 was first counted as 8 chunks never trained, epoch 0's leftover
    at 6 learners, against the survivors' batch of 4). SSGD and BMUF only: their steps are
    global steps, an epoch ``total // (BATCH * np)`` of them.
    """
    survivors = plan.np - len(leavers(plan.algo, plan.dead))
    fails = records(out, "failure")
    epoch0 = chunks_total(out) // (BATCH * plan.np)
    if plan.algo not in POOLED and fails and min(f["step"] for f in fails) >= epoch0:
        return BATCH * plan.np
    return BATCH * survivors


def chunks_total(out: Path) -> int:
    """The training set's chunks (the soak's synthetic set: every round's the same)."""
    return len(ChunkDataset(out.parent / "data" / "train.h5", 21))


def leavers(algo: str, dead: list[int]) -> set[int]:
    """The learners that leave when ``dead`` die (their super-learners, for pairs)."""
    return {r ^ 1 for r in dead} | set(dead) if algo in PAIRS else set(dead)


def failure_problem(algo: str, out: Path, job: Job, dead: list[int],
                    fault_step: int | None) -> str | None:
    """What is wrong with the ``failure`` records, or None."""
    fails = records(out, "failure")
    lost = sorted(r for f in fails for r in f["lost"])
    if lost != sorted(dead):
        return f"failure records name {lost}, not {sorted(dead)}: {fails}"
    said = [int(s) for s in re.findall(r"gone at step (\d+)", job.output)]
    if len(said) != len(fails) and not any("stopped" in f for f in fails):
        return f"{len(fails)} failure records, {len(said)} lines: {fails}"
    for i, fail in enumerate(fails):
        step = fail["step"]
        if algo in POOLED:
            if i < len(said) and step != said[i]:
                return f"failure record at step {step}, the line says {said[i]}"
        elif i < len(said) and not (said[i] - CONTROL <= step <= said[i]):
            return f"failure record at step {step}, not the control point before {said[i]}"
    if fault_step is not None and fails and algo not in POOLED:
        want = CONTROL * ((fault_step - 1) // CONTROL)
        if fails[0]["step"] != want:
            return (f"failure record at step {fails[0]['step']}, not {want} (the control "
                    f"point before the fault's step {fault_step})")
    return None


END_WORLD = re.compile(r"memory per rank at the end: .* over (\d+) ranks")


def missed_kill(plan: Plan, job: Job, out: Path) -> str | None:
    """Whether the soak's own kill landed after the job's last collective (nothing tested).

    The end-of-run memory report is a gather over the world the job ended with, after the
    last checkpoint. Where no ``failure`` record names the learner the soak killed and that
    gather counted it (the world it ended with is the one before the soak's kill), the
    process was killed on its way out, after every collective: the job's exit 0 is right,
    and the round tested nothing. Counted apart (``missed``), neither passed nor failed.
    """
    if not job.killed or job.code != 0:
        return None
    named = {r for f in records(out, "failure") for r in f["lost"]}
    if set(job.killed) & named:
        return None
    before = [r for r in plan.dead if r not in job.killed] if plan.kind == "recovery" else []
    ended = END_WORLD.findall(job.output)
    if not ended or int(ended[-1]) != plan.np - len(leavers(plan.algo, before)):
        return None
    return (f"the soak's kill of rank(s) {job.killed} landed after the job's last collective: "
            f"the end-of-run gather counted {ended[-1]} ranks, the killed one among them")


def end_problem(out: Path, world: int) -> str | None:
    """Whether the last checkpoint verifies and records ``world`` learners."""
    last = latest_checkpoint(out / "checkpoints")
    if last is None:
        return "no checkpoint"
    try:
        got = verify_checkpoint(last)["world_size"]
    except CheckpointError as err:
        return str(err)
    return None if got == world else f"last checkpoint records {got} learners, not {world}"


@dataclass
class Plan:
    """One round's choices."""

    kind: str
    algo: str
    np: int
    dead: list[int]
    fault: str = ""
    fault_step: int | None = None  # the step of an exact step fault (the record's check)
    args: list[str] = field(default_factory=list)
    resume_np: int | None = None
    meeting: int = 0  # ADPSGD: the pool's last meeting before the failure (a checkpoint's)
    wire: str = "fp32"  # --wire (BMUF's block sync, ADPSGD's gossip)
    env: dict[str, str] = field(default_factory=dict)  # more of the job's environment
    script: str = ""  # a script round's: what its rank does (soak_round3.SCRIPT_CASES)


def pick(rng: random.Random, total: int, resume_every: int, index: int) -> Plan:
    """Choose a round."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    algo = "bmuf" if kind in ("kill-sync", "stop-sync", "extend") else rng.choice(list(ALGOS))
    pairs = algo in PAIRS
    nprocs = rng.choice([4, 6, 8, 8] if pairs else [4, 5, 6, 8, 8])
    steps = total // (BATCH * nprocs)
    dead = rng.randrange(nprocs)
    plan = Plan(kind, algo, nprocs, [dead], args=["--epochs", "1"])
    if algo in WIRES:
        wires = WIRES[algo][1:] if kind == "stop-sync" else WIRES[algo]
        plan.wire = rng.choice(wires)
        if plan.wire != "fp32":
            plan.args += ["--wire", plan.wire]
    step = rng.randint(2, max(3, steps - 3)) if algo not in POOLED else rng.randint(2, 12)
    if kind in ("kill-sync", "stop-sync"):
        step = SYNC * rng.randint(1, max(1, (steps - 2) // SYNC))
    elif kind == "kill-control":
        step = CONTROL * rng.randint(1, max(1, (steps - 2) // CONTROL))
    if kind in ("kill", "kill-sync", "kill-control", "recovery"):
        plan.fault, plan.fault_step = f"kind=kill,rank={dead},step={step}", step
    elif kind == "stop-sync":
        # Frozen in a compressed block sync: the host's sentinel finds it (5 s), or with it
        # off the channel's deadline and its probe on the main control communicator.
        plan.fault, plan.fault_step = f"kind=stop,rank={dead},step={step}", step
        plan.env["HADPSGD_FROZEN_S"] = rng.choice(["5", "0"])
    elif kind == "script":
        plan.script = rng.choice(list(SCRIPT_CASES))
        plan.args, plan.wire = [], "fp32"
    elif kind == "extend":
        if rng.random() < 0.5:  # ended mid-block by --max-steps, else by its last epoch
            plan.args += ["--max-steps", str(rng.randint(SYNC + 1, steps - 2))]
    elif kind == "kill-ckpt":
        step = CONTROL * rng.randint(1, max(1, (steps - 2) // CONTROL))
        points = ["ckpt-data", "ckpt-manifest", "ckpt-rename", "ckpt-wait"]
        point = rng.choice(points + (["ckpt-part"] if algo == "bmuf" else []))
        if point == "ckpt-wait":
            dead = rng.randrange(1, nprocs)
        elif point == "ckpt-part":
            dead = 2 * rng.randrange(nprocs // 2)  # a node leader
        else:
            dead = 0
        plan.dead = [dead]
        plan.fault = f"kind=kill,rank={dead},step={step},at={point}"
        plan.args += ["--checkpoint-every", str(CONTROL)]
        plan.meeting = step
    elif kind == "kill-eval":
        # Three epochs, so that the kill as the first one ends lands while the job still
        # trains: a two-epoch run of the tiny model could end before the soak's poll saw the
        # first epoch's end (soak-elastic-default.json, rounds 22 and 53: missed kills).
        plan.args = ["--epochs", "3"]
    elif kind == "raise":
        plan.fault = f"kind=raise,rank={dead},step={step}"
    elif kind == "startup":
        what = rng.choice(["stop", "hang", "kill"])
        at = rng.choice(["startup-mpi", "startup-data", "startup-model"])
        plan.fault = f"kind={what},rank={dead},at={at}"
        plan.args += ["--max-steps", "3"]
    elif kind == "min-learners":
        other = rng.choice([r for r in range(nprocs) if r not in leavers(algo, [dead])])
        plan.dead = [dead, other]
        plan.fault = f"kind=kill,rank={dead},step={step};kind=kill,rank={other},step={step}"
        survive = nprocs - len(leavers(algo, plan.dead))
        plan.args += ["--min-learners", str(survive + 1)]
    if kind == "recovery":
        if pairs and nprocs == 4:  # two super-learners: one must stay
            plan.np = nprocs = rng.choice([6, 8])
            plan.dead = [dead := rng.randrange(nprocs)]
            # In epoch 0 of the larger world (no draw: the seed's later rounds stay the same).
            step = min(step, max(3, total // (BATCH * nprocs) - 3))
            plan.fault = f"kind=kill,rank={dead},step={step}"
        second = [r for r in range(nprocs) if r not in leavers(algo, [dead])]
        plan.dead.append(rng.choice(second))
        # A second epoch keeps the job training after the recovery for longer than the
        # second kill's lag (round 47 of soak-elastic-default.json ended 0.05 s after it).
        plan.args = ["--epochs", "2"]
    resumable = kind in ("kill", "kill-control", "min-learners") and algo not in POOLED or \
        kind in ("kill", "min-learners")
    if resume_every and index % resume_every == resume_every - 1 and resumable:
        if kind != "min-learners":
            plan.args += ["--max-steps", str(min(step + 6, steps - 1))]
        alive = nprocs - len(leavers(algo, plan.dead))
        choices = [n for n in ([2, 4, 6, 8] if pairs else [2, 3, 4, 5, 6, 8]) if n != alive]
        plan.resume_np = rng.choice(choices)
    return plan


def pid_actor(plan: Plan, rng: random.Random, total: int) -> Any:
    """The soak's own signals for ``plan`` (None where the fault does it all)."""
    if plan.kind == "kill-eval":
        lag = rng.uniform(0.0, 0.3)
        near = total - BATCH * plan.np  # the epoch's last step has begun

        def act(job: Job, proc: subprocess.Popen, out: Path, log: Path) -> bool:
            if trace_chunks(out, 0) < near:
                return False
            time.sleep(lag)
            return signal_rank(job, proc, plan.dead[0], signal.SIGKILL)
        return act
    if plan.kind == "stop":
        after = rng.randint(4, 40)  # chunks trained before the stop

        def act(job: Job, proc: subprocess.Popen, out: Path, log: Path) -> bool:
            if trace_chunks(out, 0) < after:
                return False
            return signal_rank(job, proc, plan.dead[0], signal.SIGSTOP)
        return act
    if plan.kind == "recovery":
        lag = rng.uniform(0.0, 0.4)

        def act(job: Job, proc: subprocess.Popen, out: Path, log: Path) -> bool:
            if "fault injection" not in log.read_text(errors="replace"):
                return False
            time.sleep(lag)
            return signal_rank(job, proc, plan.dead[1], signal.SIGKILL)
        return act
    return None


def script_round(plan: Plan, rng: random.Random, out: Path, data: tuple[Path, Path],
                 timeout: float) -> tuple[Job, tuple[str | None, str | None]]:
    """A user's script under the launcher's script mode, one rank ending it its own way."""
    algo = rng.choice(list(SCRIPT_ALGOS))
    step = rng.randint(2, STEPS - 2)
    plan.algo, plan.dead = algo, plan.dead[:1]
    path = write_script(out, algo, plan.dead[0], plan.script, step)
    plan.fault = f"{algo}, step {step}"
    env = {"HADPSGD_RANKS_PER_NODE": "1"} if algo == "bmuf" else {}
    job = launch(plan.np, [], out, data, "", timeout, env=env, script=[str(path)])
    return job, check_script(plan.script, plan.dead[0], job.code, job.output)


def extend_round(plan: Plan, out: Path, data: tuple[Path, Path],
                 timeout: float) -> tuple[Job, tuple[str | None, str | None]]:
    """A BMUF run ended, extended to 2 epochs, against the uninterrupted 2-epoch run.

    Ended by its epoch or by ``--max-steps`` mid-block; the final tensors must be the same
    (issue 55 item 7).
    """
    first = launch(plan.np, ALGOS[plan.algo] + plan.args, out, data, "", timeout)
    if first.code != 0:
        return first, ("exit" if first.code is not None else "hang",
                       f"first part exit {first.code}: {first.output[-1500:]}")
    wire = ["--wire", plan.wire] if plan.wire != "fp32" else []
    job = launch(plan.np, [*ALGOS[plan.algo], *wire, "--epochs", "2", "--max-steps", "0",
                           "--resume", "auto"], out, data, "", timeout)
    if job.code != 0:
        return job, ("exit" if job.code is not None else "hang",
                     f"extension exit {job.code}: {job.output[-1500:]}")
    full = launch(plan.np, [*ALGOS[plan.algo], *wire, "--epochs", "2"], out.parent /
                  f"{out.name}-full", data, "", timeout)
    if full.code != 0:
        return full, ("exit", f"uninterrupted run exit {full.code}: {full.output[-1500:]}")
    problem = compare_final(out.parent / f"{out.name}-full", out)
    return job, (("extend", problem) if problem else (None, None))


def check(plan: Plan, job: Job, out: Path, total: int) -> tuple[str | None, str | None]:
    """(what kind of problem, the problem) of a finished first job, or (None, None)."""
    if job.code is None:
        return "hang", f"still running after {job.wall_s:.0f} s: {job.output[-1500:]}"
    tail = job.output[-2000:]
    if CRASH in job.output:
        return "crash", f"exit {job.code}: {crash_line(job.output)}"
    if plan.kind == "raise":
        if job.code != 1:
            return "exit", f"exit {job.code}, not 1: {tail}"
        if not re.search(rf"failed with their own error, not a lost learner: rank "
                         rf"{plan.dead[0]} \(", job.output):
            return "message", f"no line naming rank {plan.dead[0]}'s own error: {tail}"
        took = time.time() - (job.fault_t or 0)
        if records(out, "failure"):
            return "record", "a failure record for a learner's own error"
        return (None, None) if took < 30 else ("slow", f"ended {took:.0f} s after the fault")
    if plan.kind == "startup":
        if job.code not in (1, 3):
            return "exit", f"exit {job.code}, not 1 or 3: {tail}"
        if not re.search(rf"rank\(?s?\)? {plan.dead[0]}\b|rank {plan.dead[0]} ", job.output):
            return "message", f"no line naming rank {plan.dead[0]}: {tail}"
        return None, None
    if plan.kind == "stop" and not job.killed:
        return "setup", "the soak found no rank to stop"
    if plan.kind in ("kill-eval", "recovery") and len(job.killed) < 1:
        return "setup", "the soak's own kill did not go (the job had ended?)"
    missed = missed_kill(plan, job, out)
    if missed:
        return "missed", missed
    if plan.kind == "recovery" and job.code == 1:
        # The second kill landed inside the survivors' recovery: no agreed state to go on
        # from, so every learner ends with exit 1 and one line naming the lost learners.
        said = re.search(r"error: (.*) failed \(dead, or frozen and found by MPI's failure "
                         r"detector\) outside training, while setting up or recovering",
                         job.output)
        if not said or f"rank {plan.dead[1]} " not in said[1] + " ":
            return "exit", f"exit 1 without the line naming rank {plan.dead[1]}: {tail}"
        job.landed = "inside the recovery"
        return None, None
    stopping = plan.kind == "min-learners"
    if stopping and plan.np == len(leavers(plan.algo, plan.dead)):
        # Every super-learner lost a member: nobody goes on, nothing to checkpoint.
        if job.code != 1 or "none can go on" not in job.output:
            return "exit", f"exit {job.code}, not 1 with 'none can go on': {tail}"
        return None, None
    if job.code != (1 if stopping else 0):
        return "exit", f"exit {job.code}, not {1 if stopping else 0}: {tail}"
    if plan.kind == "recovery":
        job.landed = "after the recovery"
    dead = plan.dead if plan.kind not in ("kill-eval", "stop") else job.killed
    if plan.kind == "stop-sync" and plan.env.get("HADPSGD_FROZEN_S") == "0" and \
            "killed by a learner on its host" not in job.output:
        return "message", f"frozen in a compressed sync, the sentinel off: no kill said: {tail}"
    exact = plan.fault_step if plan.kind not in ("min-learners", "recovery") else None
    problem = failure_problem(plan.algo, out, job, dead, exact)
    if problem:
        return "record", problem
    gone = leavers(plan.algo, dead)
    survivors = plan.np - len(gone)
    problem = end_problem(out, survivors)
    if problem:
        return "checkpoint", problem
    if stopping:
        fail = records(out, "failure")[-1]
        if "stopped" not in fail:
            return "record", f"the last failure record says no stop: {fail}"
        step = read_manifest(latest_checkpoint(out / "checkpoints"))["step"]
        # ADPSGD's survivors' steps go on past the failure's (their slots at fewer nodes);
        # BMUF's state is its global model's, of the last block sync (model_step).
        kept = fail.get("model_step", fail["step"])
        if step != kept and not (plan.algo in POOLED and step >= fail["step"]):
            return "record", f"the checkpoint is at step {step}, its failure record at " \
                             f"{fail['step']} (model step {kept})"
    if plan.resume_np or stopping or "--max-steps" in plan.args:
        return None, None  # an interrupted epoch: counted after its resume
    alive, lost = chunks_kept(plan.algo, trace_lines(out), kept_steps(plan, out))
    problem = chunk_problem(alive, lost, total, epoch_end_batch(plan, out))
    return ("chunks", problem) if problem else (None, None)


def resume(plan: Plan, data: tuple[Path, Path], out: Path, total: int) -> tuple[str | None,
                                                                                  str | None]:
    """Resume the round's interrupted epoch at ``plan.resume_np``; its problem, or None."""
    before = {r: len(v) for r, v in trace_lines(out).items()}
    ckpt_step = read_manifest(latest_checkpoint(out / "checkpoints"))["step"]
    args = list(ALGOS[plan.algo])
    job = launch(plan.resume_np or 0, [*args, "--resume", "auto", "--allow-resume-change", "np",
                                       "--max-steps", "0", "--epochs", "1"],
                 out, data, "", timeout=DEADLINE + 200)
    if job.code is None:
        return "hang", f"resume still running after {job.wall_s:.0f} s"
    if CRASH in job.output:
        return "crash", f"resume exit {job.code}: {crash_line(job.output)}"
    if job.code != 0:
        return "exit", f"resume exit {job.code}: {job.output[-1500:]}"
    lines = trace_lines(out)
    first = {r: recs[:before.get(r, 0)] for r, recs in lines.items()}
    second = {r: recs[before.get(r, 0):] for r, recs in lines.items()}
    # BMUF mid-block: the resume trains the block in flight again (issue 55 item 4).
    again = re.search(r"the block in flight \(steps (\d+)-\d+\), which its global model",
                      job.output)
    upto = int(again[1]) - 1 if again else ckpt_step
    alive, lost = chunks_kept(plan.algo, first, kept_steps(plan, out), upto=upto)
    more, _ = chunks_kept(plan.algo, second, {})
    for rank, recs in second.items():
        steps = [r["global_step"] for r in recs]
        if steps and (steps[0] <= upto or steps != sorted(steps)):
            return "steps", f"rank {rank}'s steps after the resume: {steps[:6]}..."
    problem = chunk_problem(alive + more, lost, total, BATCH * (plan.resume_np or 1))
    return ("chunks", problem) if problem else (None, None)


def recheck(path: Path, total: int) -> int:
    """Count again the epoch's chunks of the rounds of a soak's JSON that ``chunks`` failed.

    For a soak run with an older accounting (its run directories still there): a round
    whose counts now pass is marked ``rechecked`` with the old problem kept beside it.

    Returns:
        How many still fail.
    """
    saved = json.loads(path.read_text())
    failing = 0
    for rec in saved["rounds"]:
        if rec["what"] != "chunks":
            continue
        dead = rec["killed_pid_of"] if rec["kind"] in ("kill-eval", "stop") else rec["dead"]
        plan = Plan(rec["kind"], rec["algo"], rec["np"], dead)
        found = re.search(r"step=(\d+),at=ckpt", rec["fault"])
        plan.meeting = int(found[1]) if found else 0
        out = Path(rec["dir"])
        alive, lost = chunks_kept(plan.algo, trace_lines(out), kept_steps(plan, out))
        problem = chunk_problem(alive, lost, total, epoch_end_batch(plan, out))
        print(f"{out.name}: {rec['problem']} -> {problem or 'ok'}")
        if problem is None:
            rec.update(rechecked=f"was: {rec['problem']}", what=None, problem=None)
        failing += problem is not None
    rounds = saved["rounds"]
    whats = Counter(r["what"] for r in rounds if r["what"])
    saved["summary"].update(failed=sum(bool(r["what"]) and r["what"] != "missed" for r in rounds),
                            chunk_problems=whats["chunks"],
                            rechecked=sum("rechecked" in r for r in rounds))
    path.write_text(json.dumps(saved, indent=1) + "\n")
    return failing


def main() -> int:
    """Run the soak; exit 1 if any round failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated kinds to draw from")
    parser.add_argument("--resume-every", type=int, default=3,
                        help="every Nth round (where its kind allows) resumes at another -np")
    parser.add_argument("--until", default=None, help="stop starting rounds at HH:MM")
    parser.add_argument("--out", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rounds as JSON here")
    parser.add_argument("--recheck", action="store_true",
                        help="run nothing: count again the chunks of --json's failed rounds")
    opts = parser.parse_args()
    if opts.only:
        for kind in list(KINDS):
            if kind not in opts.only.split(","):
                del KINDS[kind]
    scratch = Path(opts.out or tempfile.mkdtemp(prefix="hadpsgd-soak-elastic-"))
    data = generate(scratch / "data", SynthSpec(feat_dim=260, num_classes=12, train_utts=60,
                                                heldout_utts=12, min_len=60, max_len=120,
                                                seed=3))
    total = len(ChunkDataset(data[0], 21))
    if opts.recheck:
        return 1 if recheck(Path(opts.json), total) else 0
    rng = random.Random(opts.seed)
    rounds: list[dict[str, Any]] = []
    for i in range(opts.rounds):
        if opts.until and datetime.datetime.now().strftime("%H:%M") >= opts.until:
            break
        plan = pick(rng, total, opts.resume_every, i)
        out = scratch / f"round-{i:03d}"
        margin = 200 if plan.np <= 6 else 260
        if plan.kind == "script":
            job, (what, problem) = script_round(plan, rng, out, data, DEADLINE + margin)
        elif plan.kind == "extend":
            job, (what, problem) = extend_round(plan, out, data, DEADLINE + margin)
        else:
            job = launch(plan.np, ALGOS[plan.algo] + plan.args, out, data, plan.fault,
                         timeout=DEADLINE + margin, act=pid_actor(plan, rng, total),
                         env=plan.env)
            what, problem = check(plan, job, out, total)
        resumed = None
        if what is None and plan.resume_np:
            what, problem = resume(plan, data, out, total)
            resumed = plan.resume_np
        fails = records(out, "failure")
        rec = {"kind": plan.kind, "algo": plan.algo, "np": plan.np, "dead": plan.dead,
               "wire": plan.wire, "script": plan.script or None, "env": plan.env,
               "fault": plan.fault, "killed_pid_of": job.killed, "exit": job.code,
               "wall_s": round(job.wall_s, 1), "resumed_at_np": resumed,
               "failure_steps": [f["step"] for f in fails],
               "recovery_s": [f["recovery_s"] for f in fails], "what": what,
               "second_kill_landed": job.landed or None, "start_retries": job.start_retries,
               "problem": problem, "dir": str(out)}
        rounds.append(rec)
        print(f"[{i + 1}/{opts.rounds}] {plan.kind:12} {plan.algo:8} {plan.wire:4} np "
              f"{plan.np} dead {plan.dead} {plan.script or plan.fault or 'os.kill'}"
              f"{f' -> resume np {resumed}' if resumed else ''}: exit {job.code} in "
              f"{rec['wall_s']} s, failures at {rec['failure_steps']}: "
              f"{(what + ': ' + (problem or '')[:600]) if what else 'ok'}", flush=True)
        if opts.json:
            Path(opts.json).write_text(json.dumps(summary(rounds, opts), indent=1) + "\n")
    result = summary(rounds, opts)
    print("\n" + json.dumps(result["summary"], indent=1))
    return 1 if result["summary"]["failed"] else 0


def summary(rounds: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, Any]:
    """The soak's figures and its rounds."""
    whats = Counter(r["what"] for r in rounds if r["what"])
    rec_s = sorted(s for r in rounds for s in r["recovery_s"])
    return {"command": f"python scripts/soak_elastic.py --rounds {opts.rounds} --seed "
                       f"{opts.seed} --resume-every {opts.resume_every}"
                       f"{f' --until {opts.until}' if opts.until else ''}",
            "summary": {
                "rounds": len(rounds),
                "failed": sum(bool(r["what"]) and r["what"] != "missed" for r in rounds),
                "missed": whats["missed"],
                "hangs": whats["hang"], "wrong_exit_codes": whats["exit"],
                "chunk_problems": whats["chunks"], "wrong_failure_steps": whats["record"],
                "crashed": whats["crash"],
                "crashed_with_exit_0": sum(r["what"] == "crash" and r["exit"] == 0
                                           for r in rounds),
                "other_problems": {k: n for k, n in whats.items()
                                   if k not in ("hang", "exit", "chunks", "record", "crash",
                                                "missed")},
                "by_kind": dict(Counter(r["kind"] for r in rounds)),
                "by_algo": dict(Counter(r["algo"] for r in rounds)),
                "by_wire": dict(Counter(r.get("wire", "fp32") for r in rounds)),
                "by_script_case": dict(Counter(r["script"] for r in rounds
                                               if r.get("script"))),
                "worlds_of_8": sum(r["np"] == 8 for r in rounds),
                "resumed_at_another_np": sum(bool(r["resumed_at_np"]) for r in rounds),
                "second_kill_inside_recovery": sum(r["second_kill_landed"] == "inside the "
                                                   "recovery" for r in rounds),
                "launches_retried": sum(r["start_retries"] for r in rounds),
                "recovery_median_s": rec_s[len(rec_s) // 2] if rec_s else None,
                "recovery_max_s": rec_s[-1] if rec_s else None,
                "max_wall_s": max((r["wall_s"] for r in rounds), default=None)},
            "rounds": rounds}


if __name__ == "__main__":
    sys.exit(main())
