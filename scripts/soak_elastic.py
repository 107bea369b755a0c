"""Elastic soak through ``python -m hadpsgd.launch -- --on-failure continue``: random kills.

Every round picks an algorithm (SSGD, BMUF on super-learners of 2, flat ADPSGD, H-ADPSGD on
super-learners of 2), a world of 4 to 8 learners (even where super-learners are of 2), and a
learner to SIGKILL (rank 0 included: it writes the run directory and hosts ADPSGD's pool) at a
random step of a one-epoch run. The survivors must go on and finish with exit 0 within the
deadline, with one ``failure`` record naming the dead learner, a last checkpoint that
verifies and records the survivors' world, and the epoch's chunks counted from the chunk
trace: every chunk of the epoch's final trajectory trained exactly once (ADPSGD: by the
survivors, the dead learner's chunks again), but for less than a global batch at its end.

    python scripts/soak_elastic.py --kills 50 [--seed 0] [--out DIR] [--json soak.json]

Prints a line per round and a summary; exit 1 if any round failed. About 10 s a round on 2
cores. Not part of the test suite (too long for CI); ``tests/mpi/test_elastic.py`` holds one
deterministic case per algorithm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hadpsgd.data import ChunkDataset  # noqa: E402
from hadpsgd.data.synth import SynthSpec, generate  # noqa: E402
from hadpsgd.launch import launch_env  # noqa: E402
from hadpsgd.train import latest_checkpoint  # noqa: E402
from hadpsgd.train.checkpoint import CheckpointError, verify_checkpoint  # noqa: E402

BATCH = 2
ALGOS: dict[str, list[str]] = {
    "ssgd": ["--algo", "ssgd"],
    "bmuf": ["--algo", "bmuf", "--ranks-per-node", "2"],
    "adpsgd": ["--algo", "adpsgd", "--super-learner-size", "1"],
    "h-adpsgd": ["--algo", "adpsgd", "--super-learner-size", "2"],
}


def launch(nprocs: int, args: list[str], out: Path, data: tuple[Path, Path], fault: str,
           timeout: float) -> tuple[int | None, str, float]:
    """One job; its exit code (None: killed at ``timeout``), output and wall time."""
    env = launch_env(nprocs=nprocs)
    env.update({"HADPSGD_TIMEOUT": "60", "HADPSGD_FAULT": fault,
                "HADPSGD_TRACE_CHUNKS": str(out / "trace"),
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), "--",
           "--train", str(data[0]), "--heldout", str(data[1]), "--preset", "tiny",
           "--out-dir", str(out), "--no-progress", "--batch-size", str(BATCH), "--epochs", "1",
           "--on-failure", "continue", "--control-every", "5", *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    return code, output, time.monotonic() - start


def chunk_problem(out: Path, algo: str, gone_ranks: set[int], kept_step: int, survivors: int,
                  total: int) -> str | None:
    """What is wrong with the epoch's chunk counts, or None.

    ``gone_ranks``: the dead learner and the members of its super-learner, which left.
    """
    alive: Counter = Counter()
    gone: set[int] = set()
    for path in (out / "trace").glob("chunks-rank*.jsonl"):
        rank = int(path.stem.removeprefix("chunks-rank"))
        steps: dict[int, list[int]] = {}
        for rec in map(json.loads, path.read_text().splitlines()):
            if algo in ("ssgd", "bmuf"):
                steps[rec["step"]] = rec["chunks"]  # a step retrained replaces its record
            else:
                steps[len(steps)] = rec["chunks"]
        for step, chunks in steps.items():
            # SSGD, BMUF: what the leavers trained up to the snapshot the survivors went on
            # from is in the model; ADPSGD: nothing of theirs counts (their model is gone).
            kept = algo in ("ssgd", "bmuf") and step <= kept_step
            (gone if rank in gone_ranks and not kept else alive).update(chunks)
    new_global = survivors * BATCH
    if algo in ("adpsgd", "h-adpsgd"):
        twice = [c for c, n in alive.items() if n > 1]
        if twice:
            return f"{len(twice)} chunks trained twice by the survivors"
        if not gone <= set(alive):
            return f"{len(gone - set(alive))} of the dead learner's chunks never trained again"
    else:
        twice = [c for c, n in alive.items() if n > 1]
        if twice:
            return f"{len(twice)} chunks trained twice"
    if total - len(alive) >= new_global + survivors * BATCH:
        return f"{total - len(alive)} of {total} chunks never trained"
    return None


def one_round(rng: random.Random, data: tuple[Path, Path], out: Path,
              total: int) -> dict[str, Any]:
    """Pick, run and check one kill; its record."""
    algo = rng.choice(list(ALGOS))
    pairs = algo in ("bmuf", "h-adpsgd")
    nprocs = rng.choice([4, 6, 8] if pairs else [4, 5, 6, 7, 8])
    dead = rng.randrange(nprocs)
    steps = total // (BATCH * nprocs)
    step = rng.randint(2, max(3, steps - 3)) if algo in ("ssgd", "bmuf") else rng.randint(2, 12)
    fault = f"kind=kill,rank={dead},step={step}"
    code, output, wall = launch(nprocs, ALGOS[algo], out, data, fault, timeout=240)
    rec: dict[str, Any] = {"algo": algo, "np": nprocs, "dead": dead, "step": step,
                           "exit": code, "wall_s": round(wall, 1)}
    leave = 2 if pairs else 1
    problem = None
    if code != 0:
        problem = f"exit {code}: {output[-1500:]}"
    else:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        failures = [r for r in map(json.loads, lines) if r["kind"] == "failure"]
        if len(failures) != 1 or failures[0]["lost"] != [dead]:
            problem = f"failure records {failures}"
        else:
            rec["recovery_s"] = failures[0]["recovery_s"]
            last = latest_checkpoint(out / "checkpoints")
            try:
                world = verify_checkpoint(last)["world_size"]
            except CheckpointError as err:
                world, problem = -1, str(err)
            if problem:
                pass
            elif world != nprocs - leave:
                problem = f"last checkpoint records {world} learners, not {nprocs - leave}"
            else:
                gone_ranks = {dead, dead ^ 1} if pairs else {dead}
                problem = chunk_problem(out, algo, gone_ranks, failures[0]["step"],
                                        nprocs - leave, total)
    rec["problem"] = problem
    return rec


def main() -> int:
    """Run the soak; exit 1 if any round failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rounds as JSON here")
    opts = parser.parse_args()
    scratch = Path(opts.out or tempfile.mkdtemp(prefix="hadpsgd-soak-elastic-"))
    data = generate(scratch / "data", SynthSpec(feat_dim=260, num_classes=12, train_utts=60,
                                                heldout_utts=12, min_len=60, max_len=120,
                                                seed=3))
    total = len(ChunkDataset(data[0], 21))
    rng = random.Random(opts.seed)
    rounds = []
    for i in range(opts.kills):
        rec = one_round(rng, data, scratch / f"round-{i:03d}", total)
        rounds.append(rec)
        print(f"[{i + 1}/{opts.kills}] {rec['algo']:8} np {rec['np']} kill rank {rec['dead']} "
              f"at step {rec['step']}: exit {rec['exit']} in {rec['wall_s']} s, recovery "
              f"{rec.get('recovery_s', '-')} s: {rec['problem'] or 'ok'}", flush=True)
    failed = [r for r in rounds if r["problem"]]
    by_algo = Counter(r["algo"] for r in rounds)
    rec_s = sorted(r["recovery_s"] for r in rounds if "recovery_s" in r)
    print(f"\n{len(rounds) - len(failed)} of {len(rounds)} rounds ok "
          f"({', '.join(f'{a} {n}' for a, n in sorted(by_algo.items()))}); recovery median "
          f"{rec_s[len(rec_s) // 2] if rec_s else '-'} s, max {rec_s[-1] if rec_s else '-'} s")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rounds, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
