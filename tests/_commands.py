"""The main command's runs through a warm world: ``run_command`` beside ``run_mpi``.

``run_command(nprocs, args)`` gives what ``run_mpi(nprocs, args)`` gives for
``args = ["-m", "hadpsgd.run", ...]`` (exit code, the ranks' output), but sends the command
to a world of ``nprocs`` ranks started once for the whole pytest session
(``tests/workers/command_server.py``), which runs ``hadpsgd.run.main`` for it: the ranks'
imports of torch and torch._dynamo, most of a short run's cost, are paid once, not per run.
Only for runs that end normally or are refused with a user's error: a run that kills, hangs,
aborts or ends the job another way is launched with ``run_mpi``, and tests of what a process
does at its end (exit codes through ``sys.exit``, MPI's finalization, signals) launch too.
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
from typing import IO

import pytest

from tests._mpi import LAUNCHES, MPI_TIMEOUT_S, ROOT, WORKERS, MPIResult, mpirun_job

COMMAND = ["-m", "hadpsgd.run"]


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

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> MPIResult:
        """Run ``hadpsgd.run.main(argv)`` on every rank; its exit code and output."""
        assert self.proc.stdin is not None
        self.errors.clear()
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env}) + "\n")
        self.proc.stdin.flush()
        end, extra = time.monotonic() + timeout, []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"hadpsgd.run {' '.join(argv)} did not finish in {timeout} s on "
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

    def close(self) -> None:
        """Let the world end by itself (no more commands), else kill it."""
        if self.alive and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


_SERVERS: dict[int, CommandServer] = {}


def run_command(nprocs: int, args: list[str], env: dict[str, str] | None = None,
                timeout: float = MPI_TIMEOUT_S) -> MPIResult:
    """``run_mpi(nprocs, args)`` for ``args`` of ``-m hadpsgd.run ...``, on a warm world."""
    if args[:2] != COMMAND:
        raise ValueError(f"run_command runs the main command only, got {args[:2]}")
    server = _SERVERS.get(nprocs)
    if server is None or not server.alive:
        server = _SERVERS[nprocs] = CommandServer(nprocs)
    return server.run(list(args[2:]), dict(env or {}), timeout)


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()
