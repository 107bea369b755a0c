"""Worker: a warm world that runs ``python -m hadpsgd.run``'s ``main`` for command after command.

A launch costs every rank an import of torch and torch._dynamo (4-5 s of CPU on the 2-core CI
machine), which is most of what a short run of the main command costs. Tests whose runs end
normally or with a user's error (a refusal, exit 2) send their commands here instead, through
``tests._commands.run_command``: rank 0 reads one JSON line a command from its standard input
(``{"argv": [...], "env": {...}}``), every rank sets the command's environment (the fault
plan read afresh), runs ``hadpsgd.run.main(argv)`` with its standard output and error
captured (as the command's own process would print them) and puts the environment back;
rank 0 prints one ``RESULT`` line: the exit code (the first non-zero rank's, as mpirun
reports it) and every rank's output in rank order. Runs that kill, hang, abort or end the
job another way are launched as before.
"""

import contextlib
import io
import json
import sys
import time
import traceback
import warnings

import numpy as np

from hadpsgd import run
from hadpsgd.comm.mpi import mpi
from tests.trainer_threads import environment

MPI = mpi()
world = MPI.COMM_WORLD


def next_command() -> dict | None:
    """Rank 0's next command (None: no more), on every rank. The others wait for it polling
    with sleeps: a blocking broadcast spins a core for as long as the server is idle, and
    that core is the one the rest of the suite needs."""
    line = sys.stdin.readline().encode() if world.rank == 0 else b""
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


while True:
    command = next_command()
    if command is None:
        break
    sys.argv = ["hadpsgd.run", *command["argv"]]  # as the command's own process has it
    out, err = io.StringIO(), io.StringIO()
    # catch_warnings: each command's warnings filters and "once per place" registry its own,
    # so a warning an earlier command gave is given again, as a fresh process would.
    with environment(command["env"]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), warnings.catch_warnings():
        try:
            code = run.main(command["argv"])
        except SystemExit as ended:
            code = ended.code if isinstance(ended.code, int) else 1
        except BaseException:  # noqa: BLE001 - said as the process would say it
            traceback.print_exc()
            code = 1
    every = world.gather((code, out.getvalue(), err.getvalue()), root=0)
    if world.rank == 0:
        codes = [c for c, _, _ in every]
        result = {"code": next((c for c in codes if c), 0),
                  "stdout": "".join(o for _, o, _ in every),
                  "stderr": "".join(e for _, _, e in every)}
        print("RESULT " + json.dumps(result), flush=True)
