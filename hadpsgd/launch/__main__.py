"""``python -m hadpsgd.launch -n 4 [--] <hadpsgd.run args>``: start a local multi-rank job."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hadpsgd.exit_codes import EXIT_FAILED
from hadpsgd.launch.forward import run_forwarding
from hadpsgd.launch.mpirun import EXITS_ENV, LauncherError, launch_env, mpirun_command


def main(argv: Sequence[str] | None = None) -> int:
    """Parse launcher options, run ``mpirun`` and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    separated = "--" in argv
    if separated:
        split = argv.index("--")
        argv, rest = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        prog="python -m hadpsgd.launch", allow_abbrev=False,
        description="Start N local ranks of python -m hadpsgd.run under the venv's mpirun, "
                    "Open MPI or MPICH (adds what a root or oversubscribed run needs). "
                    "Every other argument (or all after --) goes to hadpsgd.run.",
    )
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--module", default="hadpsgd.run",
                        help="module every rank runs (default hadpsgd.run)")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    if separated:
        opts = parser.parse_args(argv)
    else:
        # No separator: the launcher takes its own options, hadpsgd.run gets the rest.
        opts, rest = parser.parse_known_args(argv)
    try:
        cmd = mpirun_command(opts.nprocs, rest, module=opts.module)
    except LauncherError as err:
        parser.error(str(err))
    print("[hadpsgd.launch] " + " ".join(cmd), flush=True)
    if opts.dry_run:
        return 0
    # SIGTERM / Ctrl-C become a graceful stop (checkpoint, exit 75); see launch.forward.
    # Whether our stdout is a terminal: the ranks' is mpirun's pty even under `> log`.
    env = launch_env(nprocs=opts.nprocs, stdout_tty=sys.stdout.isatty())
    if "--with-ft" not in cmd or opts.module != "hadpsgd.run":
        return run_forwarding(cmd, env)
    # Under --with-ft ulfm, mpirun exits 0 when every rank ended by a signal (a crash, a
    # kill): hadpsgd.run's ranks note their own exits, and a job without one failed.
    with tempfile.TemporaryDirectory(prefix="hadpsgd-exits-") as exits:
        env[EXITS_ENV] = exits
        code = run_forwarding(cmd, env)
        if code == 0 and not any(Path(exits).iterdir()):
            print(f"hadpsgd.launch: error: every rank of the {opts.nprocs} ended by a signal "
                  "(killed or crashed: see above), none by an exit of its own; mpirun "
                  "--with-ft ulfm reports 0 for that", file=sys.stderr, flush=True)
            code = EXIT_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
