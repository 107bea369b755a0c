"""``python -m hadpsgd.launch -n 4 (SCRIPT.py | [--module M] [--]) ARGS``: a multi-rank job.

One launcher for every entry point: ``hadpsgd.run`` (the default), any module
(``--module``) or one's own script (a path, as ``torchrun`` takes it), each under the venv's
``mpirun`` with what a root or oversubscribed run needs (``launch_env``, ``local_flags``).
With ``--hosts a:4,b:4`` or ``--hostfile F`` the ranks span those hosts
(:mod:`hadpsgd.launch.hosts`), after a check that every host hears every other
(:mod:`hadpsgd.launch.preflight`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hadpsgd.exit_codes import EXIT_FAILED, EXIT_USER_ERROR
from hadpsgd.launch import hosts as multi
from hadpsgd.launch import preflight
from hadpsgd.launch.forward import run_forwarding
from hadpsgd.launch.mpirun import (
    EXITS_ENV,
    LauncherError,
    find_launcher,
    launch_env,
    mpirun_command,
)

USAGE = ("python -m hadpsgd.launch [-n N] [HOSTS] [--dry-run] SCRIPT.py [ARGS ...]\n"
         "       python -m hadpsgd.launch [-n N] [HOSTS] [--dry-run] [--module NAME] [--] "
         "[ARGS ...]\n"
         "HOSTS: (--hosts H:N,H:N | --hostfile F) [--iface NAME|SUBNET] [--ports LOW-HIGH] "
         "[--launch-agent CMD] [--no-preflight]")
DESCRIPTION = (
    "Start N local ranks under the venv's mpirun, Open MPI or MPICH, with what a root or "
    "oversubscribed run needs. Either run your own script: give its path (relative to the "
    "current directory or absolute) after the launcher's options; every argument after it "
    "goes to the script. Or run a module (--module, default hadpsgd.run): every argument "
    "that is not the launcher's own (or all after --) goes to it.")
_VALUED = ("-n", "--nprocs", "--module", "--hosts", "--hostfile", "--iface", "--ports",
           "--launch-agent", "--preflight-timeout")
"""The launcher's options that take a value."""
_BARE = ("--dry-run", "-h", "--help", "--no-preflight")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hadpsgd.launch", usage=USAGE,
                                     description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("-n", "--nprocs", type=int, default=None,
                        help="number of ranks (default 4, or every slot of --hosts)")
    parser.add_argument("--module", default="hadpsgd.run",
                        help="module every rank runs, when no script is given "
                             "(default hadpsgd.run)")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    across = parser.add_argument_group(
        "across hosts", "ranks in blocks over the hosts (the first host's slots first: a host "
        "is one of hadpsgd's nodes), started by ssh; every host needs this Python at the "
        "same path. docs/cluster.md, Across hosts")
    given = across.add_mutually_exclusive_group()
    given.add_argument("--hosts", default=None, metavar="H:N,H:N",
                       help="hosts and their slots (ranks), e.g. node1:4,node2:4")
    given.add_argument("--hostfile", default=None, metavar="FILE",
                       help="a file of lines 'HOST slots=N' (Open MPI's) or 'HOST:N'")
    across.add_argument("--iface", default=None, metavar="NAME|SUBNET",
                        help="the network MPI uses between hosts: an interface (eth0) or a "
                             "subnet (10.1.0.0/16); default: MPI's choice of every one")
    across.add_argument("--ports", default=None, metavar="LOW-HIGH",
                        help="TCP ports MPI's data connections listen on (open them in a "
                             "firewall between the hosts)")
    across.add_argument("--launch-agent", default=None, metavar="CMD",
                        help="what starts MPI's daemon on another host in place of ssh")
    across.add_argument("--no-preflight", action="store_true",
                        help="skip the check that every host hears every other")
    across.add_argument("--preflight-timeout", type=float, default=20.0, metavar="S",
                        help="seconds the check waits for each host's message (default 20)")
    return parser


def _across(opts: argparse.Namespace) -> list[multi.Host] | None:
    """The hosts of a job across hosts (None: a local job), the network flags checked."""
    if opts.hosts is None and opts.hostfile is None:
        for name in ("iface", "ports", "launch_agent"):
            if getattr(opts, name) is not None:
                raise LauncherError(f"--{name.replace('_', '-')} is for a job across hosts; "
                                    "give --hosts or --hostfile with it")
        return None
    hosts = (multi.parse_hosts(opts.hosts) if opts.hosts is not None
             else multi.read_hostfile(opts.hostfile))
    opts.iface = multi.check_network(opts.iface) if opts.iface else None
    opts.port_range = multi.parse_ports(opts.ports) if opts.ports else None
    multi.agent_exists(opts.launch_agent)
    if opts.preflight_timeout <= 0:
        raise LauncherError(f"--preflight-timeout must be > 0, got {opts.preflight_timeout}")
    return hosts


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
        hosts = _across(opts)
        nprocs = (multi.check_nprocs(opts.nprocs, hosts) if hosts is not None
                  else 4 if opts.nprocs is None else opts.nprocs)
        # Our stdout's kind goes to the ranks: theirs is mpirun's pty even under `> log`.
        env = launch_env(nprocs=nprocs if hosts is None else max(h.slots for h in hosts),
                         stdout_tty=sys.stdout.isatty())
        launcher = find_launcher()
        placement = check = None
        if hosts is not None:
            place = {"iface": opts.iface, "ports": opts.port_range, "agent": opts.launch_agent}
            placement = multi.host_flags(launcher, hosts, env, **place)
            check = preflight.command(launcher.path, hosts, multi.host_flags(
                launcher, hosts, env, one_per_host=True, **place), sys.executable,
                opts.preflight_timeout)
        cmd = mpirun_command(nprocs, rest, launcher=launcher, module=opts.module,
                             script=script, placement=placement)
    except LauncherError as err:
        parser.error(str(err))
    if check is not None and not opts.no_preflight:
        print("[hadpsgd.launch] " + " ".join(check), flush=True)
        if not opts.dry_run:
            try:
                found = preflight.run(check, hosts, env, opts.preflight_timeout, opts.iface)
            except LauncherError as err:
                print(f"hadpsgd.launch: error: {err}", file=sys.stderr, flush=True)
                return EXIT_USER_ERROR
            print("[hadpsgd.launch] " + found.line(opts.iface), flush=True)
    print("[hadpsgd.launch] " + " ".join(cmd), flush=True)
    if opts.dry_run:
        return 0
    # SIGTERM / Ctrl-C become a graceful stop (checkpoint, exit 75); see launch.forward.
    if "--with-ft" not in cmd or opts.module != "hadpsgd.run":
        return run_forwarding(cmd, env)
    # Under --with-ft ulfm, mpirun exits 0 when every rank ended by a signal (a crash, a
    # kill): hadpsgd.run's ranks note their own exits, and a job without one failed.
    with tempfile.TemporaryDirectory(prefix="hadpsgd-exits-") as exits:
        env[EXITS_ENV] = exits
        code = run_forwarding(cmd, env, exits=Path(exits), nprocs=nprocs)
        if code == 0 and not any(Path(exits).iterdir()):
            print(f"hadpsgd.launch: error: every rank of the {nprocs} ended by a signal "
                  "(killed or crashed: see above), none by an exit of its own; mpirun "
                  "--with-ft ulfm reports 0 for that", file=sys.stderr, flush=True)
            code = EXIT_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
