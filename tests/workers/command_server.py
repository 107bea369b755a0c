"""Worker: a warm world that runs ``python -m hadpsgd.run``, other modules and worker scripts,
command after command.

A launch costs every rank an import of torch and torch._dynamo (4-5 s of CPU on the 2-core CI
machine), which is most of what a short run of the main command costs. Tests whose runs end
normally or with a user's error (a refusal, exit 2) send their commands here instead, through
``tests._commands.run_command``: rank 0 reads one JSON line a command from its standard input
(``{"args": [...], "env": {...}, "cwd": ...}``: ``args`` as after ``python``, ``-m module
...`` or ``script ...``), every rank sets the command's environment (the fault plan read
afresh) and folder, runs ``hadpsgd.run.main`` (or the module or script as ``__main__``, the
script's folder first on ``sys.path``) with its standard output and error captured (as the
command's own process would print them) and puts the environment back;
rank 0 prints one ``RESULT`` line: the exit code (the first non-zero rank's, as mpirun
reports it) and every rank's output in rank order. Runs that kill, hang, abort or end the
job another way are launched as before.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import time
import traceback
import warnings

import numpy as np

from hadpsgd import cli, run
from hadpsgd.comm.mpi import mpi
from tests.trainer_threads import environment

MPI = mpi()
world = MPI.COMM_WORLD
# A refusal found before MPI starts is said by launch rank 0 alone; the others wait for the
# job to end (RANK_ZERO_GRACE_S), which in a launch rank 0's exit does at once. Here every
# rank's result is gathered whatever, so the others need not wait (15 s a refused command).
cli.RANK_ZERO_GRACE_S = 0.0


def next_command() -> dict | None:
    """Rank 0's next command (None: no more, at ``END`` or the end of its input), on every
    rank. The others wait for it polling with sleeps: a blocking broadcast spins a core for
    as long as the server is idle, and that core is the one the rest of the suite needs.
    (``END``: mpirun forwards rank 0's input but not its end.)"""
    line = sys.stdin.readline().encode() if world.rank == 0 else b""
    if line.strip() == b"END":
        line = b""
    size = np.array([len(line)], dtype=np.int64)
    request = world.Ibcast(size, root=0)
    while not request.Test():
        time.sleep(0.02)
    if not size[0]:
        return None
    data = np.frombuffer(line, dtype=np.uint8).copy() if world.rank == 0 else \
        np.empty(int(size[0]), dtype=np.uint8)
    world.Bcast(data, root=0)
    return json.loads(data.tobytes().decode())


def execute(args: list[str]) -> int:
    """Run ``python <args>`` in this process; its exit code."""
    if args[:2] == ["-m", "hadpsgd.run"]:
        sys.argv = ["hadpsgd.run", *args[2:]]  # as the command's own process has it
        return run.main(args[2:])
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    try:
        runpy.run_path(args[0], run_name="__main__")
    finally:
        sys.path.pop(0)
    return 0


def exit_code(ended: SystemExit) -> int:
    """The process's exit code for ``sys.exit(ended.code)`` (a message is printed, code 1)."""
    if ended.code is None or isinstance(ended.code, int):
        return ended.code or 0
    print(ended.code, file=sys.stderr)
    return 1


home = os.getcwd()
while True:
    command = next_command()
    if command is None:
        break
    out, err = io.StringIO(), io.StringIO()
    # catch_warnings: each command's warnings filters and "once per place" registry its own,
    # so a warning an earlier command gave is given again, as a fresh process would.
    saved = dict(os.environ)  # a worker may set variables of its own: put back after
    with environment(command["env"]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), warnings.catch_warnings():
        try:
            os.chdir(command.get("cwd") or home)
            code = execute(command["args"])
        except SystemExit as ended:
            code = exit_code(ended)
        except BaseException:  # noqa: BLE001 - said as the process would say it
            traceback.print_exc()
            code = 1
        finally:
            os.chdir(home)
    os.environ.clear()
    os.environ.update(saved)
    every = world.gather((code, out.getvalue(), err.getvalue()), root=0)
    if world.rank == 0:
        codes = [c for c, _, _ in every]
        result = {"code": next((c for c in codes if c), 0),
                  "stdout": "".join(o for _, o, _ in every),
                  "stderr": "".join(e for _, _, e in every)}
        print("RESULT " + json.dumps(result), flush=True)
