"""Fault soak through ``python -m hadpsgd.run``: random faults, then ``--resume auto``.

Every round picks an algorithm (SSGD, BMUF-Adam with overlapped means, ADPSGD, H-ADPSGD) and
a fault: SIGKILL of one rank at a step or inside a checkpoint write (data written, manifest
written, renamed into place), an exception, a hang, or SIGKILL of the whole job at a random
moment (with a checkpoint every other step, often inside a write). The faulted run must end
within its deadline; afterwards every checkpoint on disk must verify and ``latest`` must name
a complete one; then ``--resume auto`` runs to the end and must equal the uninterrupted run
bit for bit (SSGD, BMUF: model, algorithm state, position), or for ADPSGD have trained every
chunk of the epoch exactly once (its shared pool's position is in the checkpoint).

    python scripts/soak.py --faults 50 [--seed 0] [--out DIR] [--json soak.json]

Prints a line per fault and a summary table; exit 1 if any round failed. Takes about 20 s
a round on 2 cores. Not part of the test suite (too long for CI); ``tests/mpi/test_resume.py``
and ``tests/mpi/test_checkpoint_faults.py`` hold the deterministic cases.
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

import torch  # noqa: E402

from hadpsgd.data.synth import SynthSpec, generate  # noqa: E402
from hadpsgd.exit_codes import EXIT_OK  # noqa: E402
from hadpsgd.launch import launch_env, mpirun_command  # noqa: E402
from hadpsgd.train.checkpoint import (  # noqa: E402
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)

TIMEOUT_S = 15
"""HADPSGD_TIMEOUT of the faulted runs: a hang must end within it (plus the abort)."""
SYNC = ("--batch-size", "4", "--max-steps", "12", "--checkpoint-every", "2",
        "--keep-checkpoints", "2", "--control-every", "3")
ALGOS: dict[str, tuple[int, list[str]]] = {
    "ssgd": (2, ["--algo", "ssgd", "--optimizer", "sgd", "--momentum", "0.9", *SYNC]),
    "bmuf-adam-overlap": (2, ["--algo", "bmuf", "--ranks-per-node", "1", "--sync-period", "3",
                              "--bmuf-overlap", "--optimizer", "adam", "--lr", "0.002",
                              *SYNC]),
    "adpsgd": (2, ["--algo", "adpsgd", "--super-learner-size", "1", "--batch-size", "4",
                   "--epochs", "1", "--checkpoint-every", "4", "--keep-checkpoints", "2"]),
    "h-adpsgd": (4, ["--algo", "adpsgd", "--super-learner-size", "2", "--batch-size", "4",
                     "--epochs", "1", "--checkpoint-every", "4", "--keep-checkpoints", "2"]),
}
PHASES = ("ckpt-data", "ckpt-manifest", "ckpt-rename")


def run(nprocs: int, args: list[str], out: Path, data: tuple[Path, Path],
        env: dict[str, str] | None = None, kill_after: float | None = None,
        timeout: float = 240) -> tuple[int, float, str]:
    """One job; SIGKILL to all its processes after ``kill_after`` s. (code, seconds, stderr)."""
    cmd = mpirun_command(nprocs, ["--train", str(data[0]), "--heldout", str(data[1]),
                                  "--preset", "tiny", "--no-progress", "--out-dir", str(out),
                                  *args])
    full_env = launch_env(nprocs=nprocs)
    full_env.update({"HADPSGD_TIMEOUT": str(TIMEOUT_S), "HADPSGD_TRACE_CHUNKS": str(out / "trace"),
                     "PYTHONPATH": str(ROOT), **(env or {})})
    tic = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=kill_after if kill_after is not None else timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job: mpirun and every rank
        _, err = proc.communicate()
        return -9, time.monotonic() - tic, err or ""
    return proc.returncode, time.monotonic() - tic, err or ""


def same(a: Any, b: Any, where: str = "") -> str | None:
    """Where two checkpoint contents differ (bit for bit), or None."""
    if isinstance(a, torch.Tensor):
        return None if isinstance(b, torch.Tensor) and torch.equal(a, b) else where
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where} keys"
        return next((d for k in a if (d := same(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where} length"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := same(x, y, f"{where}[{i}]"))), None)
    return None if a == b else where


def disk_problem(out: Path) -> str | None:
    """A checkpoint on disk that does not verify, or a ``latest`` naming none, else None."""
    ckpts = out / "checkpoints"
    for path in list_checkpoints(ckpts):
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            return f"visible partial checkpoint: {err}"
    pointer = ckpts / "latest"
    if pointer.exists() and not (ckpts / pointer.read_text().strip()).is_dir():
        return f"latest names {pointer.read_text().strip()}, which is not there"
    return None


def pool_problem(out: Path, chunks: int) -> str | None:
    """ADPSGD: an epoch-0 chunk trained twice or not at all (the last record of a slot counts)."""
    slots = {}
    for path in (out / "trace").glob("chunks-rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            slots[(rec["epoch"], rec["step"])] = rec["chunks"]
    used = Counter(c for (e, _), cs in slots.items() if e == 0 for c in cs)
    if used and max(used.values()) > 1:
        return "a chunk was trained twice in the epoch"
    if sum(used.values()) != chunks:
        return f"{sum(used.values())} chunk uses in the epoch, {chunks} expected"
    return None


def pick(rng: random.Random, algo: str, nprocs: int) -> tuple[str, dict[str, str], float | None]:
    """A random fault: (description, environment, seconds after which to kill the job)."""
    steps = 12 if algo in ("ssgd", "bmuf-adam-overlap") else 20
    every = 2 if steps == 12 else 4
    kind = rng.choice(["kill", "kill-ckpt", "kill-ckpt", "raise", "hang", "kill-all",
                       "kill-all"])
    rank = rng.randrange(nprocs)
    if kind == "kill-ckpt":
        step = every * rng.randint(1, steps // every - 1)
        spec = f"kind=kill,rank=0,step={step},at={rng.choice(PHASES)}"
        return spec, {"HADPSGD_FAULT": spec}, None
    if kind == "kill-all":
        after = round(rng.uniform(2.0, 6.0), 2)
        return f"SIGKILL to the whole job after {after} s", {}, after
    spec = f"kind={kind},rank={rank},step={rng.randint(2, steps - 1)}"
    return spec, {"HADPSGD_FAULT": spec}, None


def main() -> int:
    """Run the soak; print and record every round; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rounds as JSON here")
    opts = parser.parse_args()
    work = Path(opts.out or tempfile.mkdtemp(prefix="hadpsgd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    data = generate(work / "data", SynthSpec(feat_dim=260, num_classes=12, train_utts=60,
                                             heldout_utts=12, min_len=60, max_len=120, seed=3))
    rng = random.Random(opts.seed)
    refs: dict[str, dict[str, Any]] = {}
    rounds = []
    for i in range(opts.faults):
        algo = rng.choice(list(ALGOS))
        nprocs, args = ALGOS[algo]
        if algo not in refs and algo in ("ssgd", "bmuf-adam-overlap"):
            code, _, err = run(nprocs, args, work / f"ref-{algo}", data)
            if code != EXIT_OK:
                raise SystemExit(f"reference run of {algo} failed:\n{err[-3000:]}")
            refs[algo] = load_checkpoint(latest_checkpoint(work / f"ref-{algo}" / "checkpoints"))
        what, env, kill_after = pick(rng, algo, nprocs)
        out = work / f"round-{i:03d}-{algo}"
        code, secs, err = run(nprocs, args, out, data, env=env, kill_after=kill_after)
        problem = None
        if secs > TIMEOUT_S + 90:
            problem = f"the faulted run took {secs:.0f} s (deadline {TIMEOUT_S} s)"
        problem = problem or disk_problem(out)
        resumes = 0
        while problem is None and resumes < 3:
            resumes += 1
            rcode, _, rerr = run(nprocs, [*args, "--resume", "auto"], out, data)
            if rcode == EXIT_OK:
                break
            if resumes == 3:
                problem = f"--resume auto failed ({rcode}): {rerr.strip().splitlines()[-1:]}"
        if problem is None:
            final = load_checkpoint(latest_checkpoint(out / "checkpoints"))
            if algo in refs:
                diff = same({k: refs[algo][k] for k in ("model", "algo", "progress")},
                            {k: final[k] for k in ("model", "algo", "progress")})
                problem = f"resumed run differs from the uninterrupted one at {diff}" if diff \
                    else None
            else:
                problem = pool_problem(out, final["progress"]["global_step"] * 4 * nprocs)
        rounds.append({"round": i, "algo": algo, "fault": what, "exit": code,
                       "seconds": round(secs, 1), "resumes": resumes, "ok": problem is None,
                       "problem": problem})
        print(f"[soak] {i:3d} {algo:18s} {what:44s} exit {code:4d} {secs:5.1f} s, "
              f"{resumes} resume(s): {'OK' if problem is None else 'FAIL ' + problem}",
              flush=True)
    failed = [r for r in rounds if not r["ok"]]
    fired = sum(r["exit"] != 0 for r in rounds)  # a fault past the run's end does not fire
    by_algo = Counter(r["algo"] for r in rounds)
    print(f"\n[soak] {len(rounds) - len(failed)} of {len(rounds)} rounds passed "
          f"({', '.join(f'{a} {n}' for a, n in sorted(by_algo.items()))}); "
          f"{fired} faults ended their run; slowest faulted run "
          f"{max(r['seconds'] for r in rounds):.1f} s")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"seed": opts.seed, "rounds": rounds}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
