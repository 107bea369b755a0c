"""A job across several hosts: the host list, the network MPI may use, and mpirun's flags.

``python -m hadpsgd.launch --hosts a:4,b:4`` (or ``--hostfile F``) starts ranks on every
host the way ``torchrun --nnodes`` and ``horovodrun -H`` users expect: ranks in blocks, the
first host's slots first, so consecutive ranks share a host and hadpsgd's nodes
(``Split_type(COMM_TYPE_SHARED)``) are the hosts. Every host runs the same Python at the same
path (a shared file system or the same install on each), started by ``ssh`` or the
``--launch-agent`` given; :mod:`hadpsgd.launch.preflight` checks that every host reaches
every other before any training starts.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hadpsgd.launch.mpirun import Launcher, LauncherError

FORWARDED = ("PYTHONPATH", "OMP_NUM_THREADS", "VIRTUAL_ENV")
"""Environment variables handed to every host's ranks (with every ``HADPSGD_*`` one): Open
MPI starts the ranks of another host from its daemon's environment, not the launcher's."""

_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


@dataclass(frozen=True)
class Host:
    """One host of the job and the ranks it takes."""

    name: str
    """Host name (or address) as ssh (or the launch agent) reaches it."""
    slots: int
    """Ranks started on it (one per GPU on a GPU node)."""


def parse_hosts(spec: str) -> list[Host]:
    """``"a:4,b:4"`` (``horovodrun -H``'s form; a bare name takes 1 slot) as hosts.

    Raises:
        LauncherError: For an empty list, a repeated host or a bad slot count, naming it.
    """
    hosts = [_host(*_name_and_slots(item), f"--hosts {item}")
             for item in (s.strip() for s in spec.split(",")) if item]
    return _checked(hosts, "--hosts")


def read_hostfile(path: str | Path) -> list[Host]:
    """Hosts from a file in Open MPI's form (``name slots=N``) or ``name:N``, one a line.

    ``#`` starts a comment; a line of a name alone takes 1 slot. MPICH's ``name:N`` and
    Open MPI's ``name slots=N`` both read, so one file serves either MPI.

    Raises:
        LauncherError: For a missing file or a line that is neither form (naming the line).
    """
    file = Path(path)
    try:
        lines = file.read_text().splitlines()
    except OSError as err:
        raise LauncherError(f"--hostfile {file}: cannot read it ({err.strerror}); give a file "
                            "of lines 'HOST slots=N' or 'HOST:N'") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {file} line {number} ({line!r})"
        words = line.split()
        slots = "1"
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "max_slots") and value:
                slots = value if key == "slots" else slots
            else:
                raise LauncherError(f"{where}: expected 'HOST slots=N' or 'HOST:N', got "
                                    f"{word!r}")
        name = words[0]
        if len(words) == 1:
            name, slots = _name_and_slots(name)
        hosts.append(_host(name, slots, where))
    return _checked(hosts, f"--hostfile {file}")


def _name_and_slots(token: str) -> tuple[str, str]:
    """``"a:4"`` as ``("a", "4")``; a bare name (or an IPv6 address) takes ``"1"``."""
    if token.count(":") != 1:
        return token, "1"
    name, _, slots = token.partition(":")
    return name, slots


def _host(name: str, slots: str, where: str) -> Host:
    if not name or not _HOST.match(name):
        raise LauncherError(f"{where}: {name!r} is no host name")
    if not slots.isdigit() or int(slots) < 1:
        raise LauncherError(f"{where}: slots must be a whole number >= 1, got {slots!r}")
    return Host(name, int(slots))


def _checked(hosts: list[Host], where: str) -> list[Host]:
    if not hosts:
        raise LauncherError(f"{where} names no host; give e.g. --hosts node1:4,node2:4")
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise LauncherError(f"{where} names {host.name} twice; give each host once with "
                                "its slots (name:N)")
        seen.add(host.name)
    return hosts


def check_nprocs(nprocs: int | None, hosts: list[Host]) -> int:
    """The job's ranks: ``-n`` if given (at most the hosts' slots), else all their slots.

    Raises:
        LauncherError: For more ranks than slots, with the count each host offers.
    """
    slots = sum(h.slots for h in hosts)
    if nprocs is None:
        return slots
    if not 1 <= nprocs <= slots:
        offer = ", ".join(f"{h.name} {h.slots}" for h in hosts)
        raise LauncherError(f"-n {nprocs} needs as many slots, the hosts offer {slots} ({offer});"
                            " give more slots (name:N) or a smaller -n")
    return nprocs


def check_network(value: str) -> str:
    """``--iface``: an interface name (``eth0``, ``ib0``) or a subnet (``10.1.0.0/16``).

    Raises:
        LauncherError: For a value that is neither (naming what it takes).
    """
    if "/" in value:
        try:
            return str(ipaddress.ip_network(value, strict=False))
        except ValueError:
            pass
    elif re.fullmatch(r"[A-Za-z0-9_.\-:@]{1,15}", value):
        return value
    raise LauncherError(f"--iface {value!r}: give the interface MPI's traffic takes between "
                        "hosts, as a name (eth0, ib0) or a subnet (10.1.0.0/16)")


def parse_ports(value: str) -> tuple[int, int]:
    """``--ports LO-HI``: the TCP ports MPI's data connections listen on (for a firewall).

    Raises:
        LauncherError: For a range outside 1024-65535 or of fewer than 2 ports.
    """
    match = re.fullmatch(r"(\d+)-(\d+)", value.strip())
    low, high = (int(match[1]), int(match[2])) if match else (0, 0)
    if not match or not 1024 <= low < high <= 65535:
        raise LauncherError(f"--ports {value!r}: give a range LOW-HIGH of at least 2 ports "
                            "within 1024-65535 (a firewall opens it between the hosts), e.g. "
                            "--ports 29500-29599")
    return low, high


def forwarded_env(env: dict[str, str]) -> list[str]:
    """Names of ``env`` every host's ranks need (:data:`FORWARDED` and ``HADPSGD_*``)."""
    return sorted(k for k in env if k in FORWARDED or k.startswith(("HADPSGD_", "_HADPSGD_")))


def host_flags(launcher: Launcher, hosts: list[Host], env: dict[str, str],
               iface: str | None = None, ports: tuple[int, int] | None = None,
               agent: str | None = None, one_per_host: bool = False) -> list[str]:
    """The mpirun flags for ranks on ``hosts`` in blocks (or one a host: ``one_per_host``).

    Open MPI: ``--host``, ``--map-by slot`` (``ppr:1:node``), ``-x`` for the environment,
    ``btl_tcp_if_include`` and ``oob_tcp_if_include`` for ``iface`` (MPI's data and its
    daemons' wiring on that network only), ``btl_tcp_port_min_v4`` / ``_range_v4`` for
    ``ports``, ``plm_ssh_agent`` for the agent. MPICH (Hydra): ``-hosts``, ``-iface``,
    ``-launcher-exec``, ``MPIR_CVAR_CH3_PORT_RANGE`` / ``MPICH_PORT_RANGE`` for the ports;
    Hydra hands every host the whole environment itself.

    Raises:
        LauncherError: For a launcher of unknown flavour (it may take none of these).
    """
    placed = ",".join(f"{h.name}:{1 if one_per_host else h.slots}" for h in hosts)
    if launcher.flavour == "openmpi":
        flags = ["--host", placed, "--map-by", "ppr:1:node" if one_per_host else "slot",
                 "--bind-to", "none"]
        for name in forwarded_env(env):
            flags += ["-x", name]
        if iface:
            flags += ["--prtemca", "oob_tcp_if_include", iface,
                      "--mca", "btl_tcp_if_include", iface]
        if ports:
            flags += ["--mca", "btl_tcp_port_min_v4", str(ports[0]),
                      "--mca", "btl_tcp_port_range_v4", str(ports[1] - ports[0] + 1)]
        if agent:
            flags += ["--prtemca", "plm_ssh_agent", agent]
        return flags
    if launcher.flavour == "mpich":
        flags = ["-hosts", placed, "-bind-to", "none"]
        if iface:
            if "/" in iface:
                raise LauncherError("MPICH's --iface takes an interface name (eth0), not a "
                                    f"subnet ({iface})")
            flags += ["-iface", iface]
        if ports:
            span = f"{ports[0]}:{ports[1]}"
            flags += ["-genv", "MPIR_CVAR_CH3_PORT_RANGE", span, "-genv", "MPICH_PORT_RANGE",
                      span]
        if agent:
            flags += ["-launcher", "ssh", "-launcher-exec", agent]
        return flags
    raise LauncherError(f"a job across hosts needs Open MPI's or MPICH's launcher; "
                        f"{launcher.path} is neither, start it with your site's launcher "
                        "(docs/cluster.md)")


def agent_exists(agent: str | None) -> None:
    """Refuse a ``--launch-agent`` path that is no executable (before any host is tried)."""
    if agent is None or "/" not in agent.split()[0]:
        return
    path = agent.split()[0]
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise LauncherError(f"--launch-agent {path}: no executable file there; give ssh's "
                            "path or a script that runs its arguments on the host named first")


__all__ = ["FORWARDED", "Host", "agent_exists", "check_network", "check_nprocs",
           "forwarded_env", "host_flags", "parse_hosts", "parse_ports", "read_hostfile"]
