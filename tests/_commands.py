"""Commands and workers through a warm world: ``run_command`` beside ``run_mpi``.

``run_command(nprocs, args)`` gives what ``run_mpi(nprocs, args)`` gives (exit code, the
ranks' output) for ``args`` of the main command (``-m hadpsgd.run ...``), another module
(``-m hadpsgd.forward ...``) or a script (``run_worker_warm`` for ``tests/workers/``), but
sends the command to a world of ``nprocs`` ranks started once for the whole pytest session
(``tests/workers/command_server.py``), which runs it in its processes: the ranks' imports of
torch and torch._dynamo, most of a short job's cost, are paid once, not per job.
Only for jobs that end normally or are refused with a user's error, and for workers that
leave nothing behind in the process (no patched module, every communicator freed): a job
that kills, hangs, aborts or ends the job another way is launched with ``run_mpi``, and
tests of what a process does at its end (exit codes through ``sys.exit``, MPI's
finalization, signals) launch too.
A server that dies is started again for the next command; every command has a wall-clock
limit, past which the server is killed and the test fails with what it printed.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from tests._mpi import (
    LAUNCH_TRIES,
    LAUNCHES,
    MPI_TIMEOUT_S,
    ROOT,
    WORKERS,
    MPIResult,
    launcher_failed_to_start,
    mpirun_job,
)


class CommandServer:
    """One warm world of ``nprocs`` ranks (see the module's text)."""

    def __init__(self, nprocs: int) -> None:
        cmd, env = mpirun_job(nprocs, [str(WORKERS / "command_server.py")])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self._error),
                         daemon=True).start()
        LAUNCHES.append({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                         "nprocs": nprocs, "args": ["command_server"], "seconds": 0.0})

    @staticmethod
    def _read(stream: IO[str] | None, put: Callable[[str | None], None]) -> None:
        assert stream is not None
        for line in stream:
            put(line)
        put(None)

    def _error(self, line: str | None) -> None:
        if line is not None:
            self.errors.append(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, args: list[str], env: dict[str, str], timeout: float,
            cwd: Path | None = None) -> MPIResult:
        """Run ``python <args>`` on every rank; its exit code and output."""
        assert self.proc.stdin is not None
        self.errors.clear()
        command = {"args": args, "env": env, "cwd": str(cwd) if cwd else None}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        end, extra = time.monotonic() + timeout, []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"{' '.join(args)} did not finish in {timeout} s on "
                            f"the command server (hang?)\nstdout:\n{''.join(extra)}\n"
                            f"stderr:\n{''.join(self.errors)}")
            if line is None:  # the world ended: said as a launch's end would say it
                code = self.proc.wait()
                return MPIResult(code, "".join(extra), "".join(self.errors))
            if line.startswith("RESULT "):
                got = json.loads(line.removeprefix("RESULT "))
                return MPIResult(got["code"], "".join(extra) + got["stdout"],
                                 got["stderr"] + "".join(self.errors))
            extra.append(line)

    def kill(self) -> None:
        """End the world now (its process group)."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def end(self) -> None:
        """Ask the world to end by itself (no more commands): ``close`` waits for it."""
        if self.alive and self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.write("END\n")  # (mpirun forwards input, not its end)
            self.proc.stdin.close()

    def close(self, wait: float = 20.0) -> None:
        """``end``, then wait up to ``wait`` s for the world to end, else kill it."""
        self.end()
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.kill()


_SERVERS: dict[int, CommandServer] = {}
"""The warm worlds of this pytest process by size, the most recently used last."""

WARM_RANKS = 12
"""Most ranks kept warm by one pytest process (~250 MB each): a world that would take more
ends the least recently used ones first (two test processes, ``pytest -n 2``, would
otherwise keep a world of every size each)."""


def _make_room(nprocs: int) -> None:
    """End the least recently used worlds until one of ``nprocs`` ranks fits."""
    while _SERVERS and sum(_SERVERS) + nprocs > WARM_RANKS:
        _SERVERS.pop(next(iter(_SERVERS))).close()


def run_command(nprocs: int, args: list[str], env: dict[str, str] | None = None,
                timeout: float = MPI_TIMEOUT_S, cwd: Path | None = None) -> MPIResult:
    """``run_mpi(nprocs, args)`` on a warm world (``-m module ...`` or ``script ...``)."""
    if not args or (args[0] == "-m" and len(args) < 2):
        raise ValueError(f"run_command needs -m module or a script, got {args}")
    for _ in range(LAUNCH_TRIES):
        server = _SERVERS.pop(nprocs, None)
        if server is None or not server.alive:
            _make_room(nprocs)
            server = CommandServer(nprocs)
        _SERVERS[nprocs] = server  # the most recently used, last
        res = server.run(list(args), dict(env or {}), timeout, cwd)
        # The launcher's own start-up failure: no rank ran, the command neither (as run_mpi)
        if server.alive or not launcher_failed_to_start(res.output):
            break
    return res


def run_worker_warm(nprocs: int, worker: str, *args: str, env: dict[str, str] | None = None,
                    timeout: float = MPI_TIMEOUT_S) -> MPIResult:
    """``run_worker(nprocs, worker, *args)`` on a warm world (see the module's text)."""
    return run_command(nprocs, [str(WORKERS / f"{worker}.py"), *args], env=env,
                       timeout=timeout)


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():  # every world ends at once, then each is awaited
        server.end()
    for server in _SERVERS.values():
        server.close()
