"""``python -m hadpsgd.launch -n 4 (SCRIPT.py | [--module M] [--]) ARGS``: a local multi-rank job.

One launcher for every entry point: ``hadpsgd.run`` (the default), any module
(``--module``) or one's own script (a path, as ``torchrun`` takes it), each under the venv's
``mpirun`` with what a root or oversubscribed run needs (``launch_env``, ``local_flags``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hadpsgd.exit_codes import EXIT_FAILED
from hadpsgd.launch.forward import run_forwarding
from hadpsgd.launch.mpirun import EXITS_ENV, LauncherError, launch_env, mpirun_command

USAGE = ("python -m hadpsgd.launch [-n N] [--dry-run] SCRIPT.py [ARGS ...]\n"
         "       python -m hadpsgd.launch [-n N] [--dry-run] [--module NAME] [--] [ARGS ...]")
DESCRIPTION = (
    "Start N local ranks under the venv's mpirun, Open MPI or MPICH, with what a root or "
    "oversubscribed run needs. Either run your own script: give its path (relative to the "
    "current directory or absolute) after the launcher's options; every argument after it "
    "goes to the script. Or run a module (--module, default hadpsgd.run): every argument "
    "that is not the launcher's own (or all after --) goes to it.")
_VALUED = ("-n", "--nprocs", "--module")
"""The launcher's options that take a value."""
_BARE = ("--dry-run", "-h", "--help")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hadpsgd.launch", usage=USAGE,
                                     description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--module", default="hadpsgd.run",
                        help="module every rank runs, when no script is given "
                             "(default hadpsgd.run)")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    return parser


def _own(arg: str) -> int:
    """How many tokens the launcher's option ``arg`` takes up (0: it is not the launcher's)."""
    if arg in _VALUED:
        return 2
    if arg in _BARE or arg.startswith(("--nprocs=", "--module=")):
        return 1
    return 1 if arg.startswith("-n") and arg[2:].isdigit() else 0


def split_script(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """``argv`` as (the launcher's options, the script, the script's arguments).

    A script is the first token after the launcher's own options that is no option and
    names a Python file (``.py``, or an existing file). Without one (or with ``--module``)
    the script is None and ``argv`` is returned whole: the module's arguments are mixed in.

    Raises:
        LauncherError: For an option the launcher does not know before a script (with the
            launcher's option it resembles, if any).
    """
    i = 0
    while i < len(argv) and argv[i] != "--":
        arg = argv[i]
        taken = _own(arg)
        if arg == "--module" or arg.startswith("--module="):
            return argv, None, []
        if taken:
            i += taken
            continue
        if not arg.startswith("-") and (arg.endswith(".py") or Path(arg).is_file()):
            return argv[:i], arg, argv[i + 1:]
        later = [a for a in argv[i + 1:argv.index("--") if "--" in argv else None]
                 if a.endswith(".py") and not a.startswith("-")]
        if arg.startswith("-") and later:
            near = difflib.get_close_matches(arg.partition("=")[0], (*_VALUED, *_BARE), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise LauncherError(f"unrecognized launcher option {arg}{hint} before the script "
                                f"{later[0]}: the launcher's options (-n, --dry-run) come "
                                "before the script, the script's own after it")
        break
    return argv, None, []


def main(argv: Sequence[str] | None = None) -> int:
    """Parse launcher options, run ``mpirun`` and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        own, script, rest = split_script(argv)
    except LauncherError as err:
        parser.error(str(err))
    if script is not None:
        opts = parser.parse_args(own)
    elif "--" in argv:
        split = argv.index("--")
        opts, rest = parser.parse_args(argv[:split]), argv[split + 1:]
    else:
        # No separator: the launcher takes its own options, the module gets the rest.
        opts, rest = parser.parse_known_args(argv)
    try:
        cmd = mpirun_command(opts.nprocs, rest, module=opts.module, script=script)
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
