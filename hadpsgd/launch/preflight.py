"""Before a job across hosts: every host starts a rank and hears every other over MPI.

A multi-host job that fails at its first collective has already paid for its start-up and
says little about why (a host ssh cannot reach, a Python missing at the path, a firewall
between two hosts, MPI picking an interface the other host cannot route to). The launcher
therefore first runs :mod:`hadpsgd.comm.reach` on one rank a host, under the same flags as
the job (interface, ports, launch agent), with a time limit, and turns its reports into
one message naming the host (or pair of hosts) at fault and what to change.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from hadpsgd.launch.hosts import Host
from hadpsgd.launch.mpirun import LauncherError

PREFIX = "HADPSGD_REACH "
"""The report line's start (:data:`hadpsgd.comm.reach.PREFIX`; the launcher imports no MPI)."""

AGREE = ("python", "torch", "hadpsgd", "mpi")
"""Versions every host must share (pickled objects and MPI's wire cross between them)."""


@dataclass(frozen=True)
class Reached:
    """What the check found: every host and how long the slowest took to be heard."""

    hosts: list[str]
    seconds: float
    """Wall time of the whole check (start-up of every host's rank included)."""
    slowest: float
    """The longest any rank waited for a peer's message."""

    def line(self, network: str | None) -> str:
        """One line for the launcher's output."""
        over = f" over {network}" if network else ""
        return (f"preflight: {len(self.hosts)} hosts ({', '.join(self.hosts)}) hear each "
                f"other over MPI{over}; checked in {self.seconds:.1f} s")


def command(launcher_path: str, hosts: list[Host], flags: list[str], python: str,
            deadline_s: float) -> list[str]:
    """The check's command: one rank a host (``flags`` place them so) running the probe."""
    return [launcher_path, "-np", str(len(hosts)), *flags, python, "-m", "hadpsgd.comm.reach",
            "--deadline", f"{deadline_s:g}", *(h.name for h in hosts)]


def run(cmd: list[str], hosts: list[Host], env: dict[str, str], deadline_s: float,
        network: str | None) -> Reached:
    """Run the check; return what it found, or raise naming the host at fault.

    Args:
        cmd: From :func:`command`.
        hosts: The job's hosts, in the order ``cmd`` names them.
        env: The launch environment.
        deadline_s: The probe's own wait for peers; the whole check may take the hosts'
            start-up on top (60 s more) before it is stopped.
        network: The ``--iface`` given, for the messages.

    Raises:
        LauncherError: Naming the host that did not start or report, the pair that does
            not hear each other, or the host whose versions differ, with the way on.
    """
    start = time.monotonic()
    limit = deadline_s + 60.0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(stopped after {limit:.0f} s)"
    reports = parse(out)
    return judge(reports, [h.name for h in hosts], proc.returncode, out,
                 time.monotonic() - start, network)


def parse(out: str) -> dict[str, dict[str, Any]]:
    """The probes' reports in ``out``, by the host name the launcher gave."""
    reports: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        at = line.find(PREFIX)
        if at < 0:
            continue
        try:
            report = json.loads(line[at + len(PREFIX):])
        except ValueError:
            continue
        if isinstance(report, dict) and "named" in report:
            reports[str(report["named"])] = report
    return reports


def judge(reports: dict[str, dict[str, Any]], names: list[str], code: int | None, out: str,
          seconds: float, network: str | None) -> Reached:
    """The verdict on the reports (see :func:`run`)."""
    tail = "\n".join(out.strip().splitlines()[-12:])
    silent = [n for n in names if n not in reports]
    if silent:
        # A host whose daemon did not start keeps every rank from starting (none reports):
        # Open MPI names it as the "Remote host" of its message; name that one then.
        blamed = [n for n in silent if n in re.findall(r"Remote host:\s*(\S+)", out)]
        which = ", ".join(blamed or silent)
        raise LauncherError(
            f"preflight: no report from {which}: its rank did not start or could not reach "
            "the launcher's host. Check that 'ssh HOST' works without a password (or "
            "--launch-agent), that this Python and hadpsgd are at the same path there, and "
            "that MPI's runtime may connect back (--iface). mpirun said:\n" + tail)
    pairs = sorted({tuple(sorted((n, m))) for n in names for m in reports[n]["missed"]})
    if pairs:
        over = f" over {network}" if network else ""
        said = "; ".join(f"{a} and {b}" for a, b in pairs)
        raise LauncherError(
            f"preflight: MPI messages do not get through between {said}{over} within "
            f"{max(r['seconds'] for r in reports.values()):.0f} s: a firewall between them, "
            "or an interface one cannot route to. Give the network both reach with --iface "
            "(a name or a subnet) and open MPI's ports between the hosts (fix them with "
            "--ports LOW-HIGH); docs/cluster.md, *Across hosts*")
    first = reports[names[0]]["versions"]
    for name in names[1:]:
        theirs = reports[name]["versions"]
        differ = [f"{k} {theirs.get(k)} (on {names[0]}: {first.get(k)})" for k in AGREE
                  if theirs.get(k) != first.get(k)]
        if differ:
            raise LauncherError(f"preflight: {name} runs {', '.join(differ)}; every host needs "
                                "the same versions (the same environment at the same path)")
    if code not in (0, None):
        raise LauncherError(f"preflight: every host reported, but the check ended with exit "
                            f"{code}:\n{tail}")
    slowest = max((max(r["heard"].values(), default=0.0) for r in reports.values()),
                  default=0.0)
    return Reached(names, seconds, slowest)


__all__ = ["AGREE", "PREFIX", "Reached", "command", "judge", "parse", "run"]
