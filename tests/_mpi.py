"""Helpers for the multi-rank tests: run real ``mpirun`` jobs, each under a wall-clock limit.

Imported by test modules (``from tests._mpi import run_worker``); ``conftest.py`` holds only
pytest's fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# A launch whose launcher failed to start (no rank ran) is retried: hadpsgd.launch.mpirun.
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
SITE = Path(__file__).resolve().parent / "_site"
"""Put first on the ranks' path by :func:`job_env`: their ``sitecustomize``."""
# Every mpirun launch gets a hard wall-clock limit: a hang fails the test instead of CI.
MPI_TIMEOUT_S = float(os.environ.get("HADPSGD_TEST_MPI_TIMEOUT", "240"))
# Where each launch's test, ranks and seconds are appended (JSON lines) when set: what the
# multi-rank suite spends goes mostly to launches (each rank imports torch), so CI's time is
# planned from this record.
LAUNCH_LOG = os.environ.get("HADPSGD_TEST_LAUNCH_LOG")
LAUNCHES: list[dict] = []
"""Every launch of this pytest process (test, ranks, seconds): ``conftest.py`` sums them."""


@dataclass
class MPIResult:
    """What a finished ``mpirun`` job left behind."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def job_env(nprocs: int) -> dict[str, str]:
    """The environment of a test's job of ``nprocs`` ranks: the launcher's, a 60 s deadline
    unless set, this checkout first on the path.

    MPI's start-up gets 60 s of its own (``HADPSGD_START_TIMEOUT``) unless a test sets it:
    a test's short ``HADPSGD_TIMEOUT`` is for the fault it injects, and on two busy cores a
    rank may still be importing torch 4 s after its peers reached ``MPI_Init`` (a CI run
    failed so: ``test_faults`` at 4 s).

    The ranks import a stand-in for ``torch._dynamo`` (``tests/_site/sitecustomize.py``: the
    import every ``torch.optim`` optimizer makes, ~1.2 s of CPU a rank, a fifth of the
    multi-rank suite's time) unless the test's ``env`` sets ``HADPSGD_TEST_DYNAMO_STANDIN=0``
    or the suite runs with ``HADPSGD_TEST_REAL_DYNAMO=1``.
    """
    from hadpsgd.launch import launch_env

    env = launch_env(nprocs=nprocs)
    env.setdefault("HADPSGD_TIMEOUT", "60")
    env.setdefault("HADPSGD_START_TIMEOUT", "60")
    return {**env, **ranks_python(env.get("PYTHONPATH", ""))}


def ranks_python(path: str = "") -> dict[str, str]:
    """A test rank's ``PYTHONPATH`` (its ``sitecustomize``'s folder, this checkout, then
    ``path``) and the switch of the ``torch._dynamo`` stand-in (:func:`job_env`)."""
    # Once each, in order: an inherited path may hold both already (the lab's environment).
    entries = dict.fromkeys([str(SITE), str(ROOT), *path.split(os.pathsep)])
    env = {"PYTHONPATH": os.pathsep.join(e for e in entries if e)}
    if os.environ.get("HADPSGD_TEST_REAL_DYNAMO") != "1":
        env["HADPSGD_TEST_DYNAMO_STANDIN"] = "1"
    return env


def mpirun_job(nprocs: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line of ``mpirun -np nprocs python <args>`` and its environment
    (:func:`job_env`)."""
    from hadpsgd.launch import mpirun_command

    cmd = mpirun_command(nprocs, [], module="x")[:-3]  # launcher + its local flags
    cmd += [sys.executable, *args]
    return cmd, job_env(nprocs)


def run_mpi(nprocs: int, args: list[str], timeout: float = MPI_TIMEOUT_S,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> MPIResult:
    """Run ``mpirun -np nprocs python <args>`` (args start with ``-m mod`` or a script path)."""
    cmd, full_env = mpirun_job(nprocs, args)
    full_env.update(env or {})
    started = time.monotonic()
    for _ in range(LAUNCH_TRIES):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env=full_env, cwd=cwd or ROOT)
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"mpirun -np {nprocs} {' '.join(args)} did not finish in {timeout} s "
                        f"(hang?)\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}")
        if out.returncode == 0 or not launcher_failed_to_start(out.stdout + out.stderr):
            break
    launch = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)"),
              "nprocs": nprocs, "args": args[:2],
              "seconds": round(time.monotonic() - started, 2)}
    LAUNCHES.append(launch)
    if LAUNCH_LOG:
        with open(LAUNCH_LOG, "a") as f:
            f.write(json.dumps(launch) + "\n")
    return MPIResult(out.returncode, out.stdout, out.stderr)


def run_worker(nprocs: int, worker: str, *args: str, **kw: object) -> MPIResult:
    """Run ``tests/workers/<worker>.py`` on ``nprocs`` ranks."""
    return run_mpi(nprocs, [str(WORKERS / f"{worker}.py"), *args], **kw)  # type: ignore[arg-type]


def assert_ok(res: MPIResult) -> None:
    """Fail with the job's output if it did not exit 0."""
    assert res.returncode == 0, f"exit {res.returncode}\n{res.output[-6000:]}"
