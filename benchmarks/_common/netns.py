"""Two hosts on one machine: ranks in two network namespaces joined by a throttled veth pair.

Every "inter-node" link of a one-machine run is shared memory. This harness puts half of the
ranks in network namespace A and half in B (each with its own host name, so Open MPI and
``hadpsgd.comm.init`` see two nodes), joins them by a veth pair with a token-bucket rate
limit (``tc tbf``) and, where the kernel has it, ``tc netem`` latency (where it has not, a
link with latency is two TAP devices joined in user space: :mod:`benchmarks._common.slowlink`),
and starts the job with
Open MPI's ``mpirun`` in A, whose daemon for B is launched by an agent that enters B. MPI
between the hosts then runs over TCP through a real network stack; inside a host it keeps
shared memory.

It needs root (namespaces, links, qdiscs), ``ip``, ``tc``, ``unshare`` and Open MPI's
``mpirun``; :func:`available` says whether all is there and, if not, why. Used by
``tests/mpi/test_two_hosts.py``::

    with TwoHosts(rate="300mbit") as hosts:
        subprocess.run(hosts.mpirun(4, [sys.executable, "-m", "hadpsgd.run", ...]))
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common.slowlink import DelayForwarder, open_tap, parse_delay, parse_rate
from hadpsgd.launch.mpirun import find_launcher

HOSTS = ("hosta", "hostb")
"""The two host names (namespace A runs mpirun)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def available() -> tuple[bool, str]:
    """Whether this machine can run :class:`TwoHosts`, and if not the reason (one line)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, veth links, tc qdiscs)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return False, f"needs the {tool!r} command (iproute2 / util-linux)"
    try:
        launcher = find_launcher()
    except Exception as err:  # noqa: BLE001 - any launcher problem is a skip reason
        return False, str(err)
    if launcher.flavour != "openmpi":
        return False, f"needs Open MPI's mpirun, found {launcher.flavour} at {launcher.path}"
    name = f"hxprobe{os.getpid()}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return False, f"cannot create a network namespace: {probe.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return True, ""


def netem_available() -> bool:
    """Whether the kernel has ``tc netem`` (latency emulation); tried on a throwaway link."""
    name = f"hxnetem{os.getpid()}"
    if _run("ip", "netns", "add", name, check=False).returncode != 0:
        return False
    try:
        return _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                    "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "netns", "del", name, check=False)


def set_up(harness: Any, what: str) -> Any:
    """Enter ``harness`` (its ``_create``, its ``close`` on any failure) where root allows.

    Raises:
        RuntimeError: Naming ``what`` and why it is not possible here.
    """
    ok, why = available()
    if not ok:
        raise RuntimeError(f"{what} are not possible here: {why}")
    try:
        harness._create()  # noqa: SLF001 - the harness's own set-up
    except BaseException:
        harness.close()
        raise
    return harness


def tcp_mpirun(nprocs: int, hosts: str, agent: str, subnet: str, env: dict[str, str],
               argv: list[str]) -> list[str]:
    """Open MPI's command for ``argv`` on ``hosts`` (``name:slots,...``), TCP on ``subnet``.

    The other hosts' daemons start through ``agent`` (in place of ssh); ``env``, with
    ``PYTHONPATH``, ``OMP_NUM_THREADS`` and every ``HADPSGD_*`` set here, goes to every rank.
    """
    names = sorted({"PYTHONPATH", "OMP_NUM_THREADS", *env,
                    *(k for k in os.environ if k.startswith("HADPSGD_"))})
    forward: list[str] = []
    for name in names:
        if name in env or name in os.environ:
            forward += ["-x", f"{name}={env.get(name, os.environ.get(name, ''))}"]
    return [find_launcher().path, "-np", str(nprocs), "--host", hosts, "--map-by", "slot",
            "--bind-to", "none", "--prtemca", "plm_ssh_agent", agent, "--prtemca",
            "plm_ssh_no_tree_spawn", "1", "--prtemca", "oob_tcp_if_include", subnet,
            "--mca", "btl", "tcp,self,sm", "--mca", "btl_tcp_if_include", subnet,
            *forward, *argv]


class TwoHosts:
    """Two emulated hosts joined by one throttled link (a context manager).

    Args:
        rate: The link's rate each way, in tc's units (``300mbit``); None: unthrottled.
        delay: One-way latency (``2ms``); None: none. Through ``tc netem`` where the kernel
            has it (see :func:`netem_available`), else through the user-space link.
        env: Environment variables forwarded to every rank (``mpirun -x``), besides
            ``PYTHONPATH``, ``OMP_NUM_THREADS`` and every ``HADPSGD_*`` set.
        link: ``veth`` (the kernel's pair, shaped by tc), ``tap`` (the user-space link of
            :mod:`benchmarks._common.slowlink`, rate and delay in this process), or ``auto``:
            ``tap`` where latency is asked for and the kernel has no netem, else ``veth``.
    """

    def __init__(self, rate: str | None = "300mbit", delay: str | None = None,
                 env: dict[str, str] | None = None, link: str = "auto") -> None:
        if link not in ("auto", "veth", "tap"):
            raise ValueError(f"link must be auto, veth or tap, got {link!r}")
        tag = os.getpid() % 200 + 20
        self.namespaces = (f"hx{os.getpid()}a", f"hx{os.getpid()}b")
        self.links = (f"hx{tag}a", f"hx{tag}b")
        self.addresses = (f"10.77.{tag}.1", f"10.77.{tag}.2")
        self.subnet = f"10.77.{tag}.0/24"
        self.rate = rate
        self.delay = delay
        self.env = dict(env or {})
        self.link = link
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._taps: list[int] = []
        self._timing: tuple[float | None, float] = (None, 0.0)
        """The user-space link's rate (bits a second, None: unthrottled) and delay (s)."""
        self.forwarder: DelayForwarder | None = None
        """The user-space link's forwarder (its byte and drop counts), where it is one."""

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> TwoHosts:
        if self.link == "auto":
            self.link = "tap" if self.delay and not netem_available() else "veth"
        if self.link == "tap":  # read (and refused) before anything is made
            self._timing = (parse_rate(self.rate) if self.rate else None,
                            parse_delay(self.delay or "0s"))
        return set_up(self, "two emulated hosts")

    @property
    def userspace(self) -> bool:
        """Whether the link is the user-space one (rate and delay in this process)."""
        return self.link == "tap"

    def _create(self) -> None:
        ns_b, (link_a, link_b) = self.namespaces[1], self.links
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
        if self.userspace:
            # Made here, opened (the descriptors keep them), then moved into the hosts.
            self._taps = [open_tap(link) for link in self.links]
        else:
            _run("ip", "link", "add", link_a, "type", "veth", "peer", "name", link_b)
        for ns, link, addr in zip(self.namespaces, self.links, self.addresses, strict=True):
            _run("ip", "link", "set", link, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if not self.userspace:
                self._shape(ns, link)
        if self.userspace:
            self.forwarder = DelayForwarder(*self._taps, *self._timing).start()
        self._dir = tempfile.TemporaryDirectory(prefix="hadpsgd-netns-")
        # mpirun starts the daemon of host B through this agent (in place of ssh).
        agent = Path(self._dir.name) / "agent.sh"
        agent.write_text(
            "#!/bin/bash\n"
            "# mpirun's remote-launch agent: enter host B's namespace under its host name.\n"
            'host="$1"; shift\n'
            f'exec ip netns exec {shlex.quote(ns_b)} unshare --uts bash -c "hostname $host; $*"\n'
        )
        agent.chmod(0o755)

    def _shape(self, ns: str, link: str) -> None:
        if self.delay:
            spec = ["netem", "delay", self.delay]
            if self.rate:
                spec += ["rate", self.rate]
        elif self.rate:
            # A bucket of ~10 ms at the rate (at least 64 KiB) and at most 50 ms of queue.
            spec = ["tbf", "rate", self.rate, "burst", "64kb", "latency", "50ms"]
        else:
            return
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", *spec)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces (the veth pair goes with them) and the agent; idempotent."""
        if self.forwarder is not None:
            self.forwarder.stop()
            self.forwarder = None
        for fd in self._taps:  # the TAP devices go with their last descriptor
            os.close(fd)
        self._taps = []
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # ------------------------------------------------------------------ use
    def mpirun(self, nprocs: int, argv: list[str]) -> list[str]:
        """The command that runs ``argv`` on ``nprocs`` ranks, half on each host.

        Ranks 0 .. n/2-1 are on host A, the rest on host B (consecutive, like ``--map-by
        ppr:k:node``). MPI between the hosts uses TCP over the veth pair only.
        """
        if nprocs < 2 or nprocs % 2:
            raise ValueError(f"nprocs must be even and >= 2 (half per host), got {nprocs}")
        if self._dir is None:
            raise RuntimeError("use TwoHosts as a context manager (with TwoHosts() as h: ...)")
        per = nprocs // 2
        cmd = tcp_mpirun(nprocs, f"{HOSTS[0]}:{per},{HOSTS[1]}:{per}", self.agent,
                         self.subnet, self.env, argv)
        return self.on_host_a(cmd)

    @property
    def agent(self) -> str:
        """The script that starts a command on host B in place of ssh (``plm_ssh_agent``)."""
        if self._dir is None:
            raise RuntimeError("use TwoHosts as a context manager (with TwoHosts() as h: ...)")
        return str(Path(self._dir.name) / "agent.sh")

    def on_host_a(self, argv: list[str]) -> list[str]:
        """``argv`` run on host A (its namespace, its host name).

        E.g. ``hadpsgd.launch --hosts hosta:2,hostb:2 --launch-agent`` :attr:`agent`
        ``--iface`` :attr:`subnet`.
        """
        inner = "hostname " + HOSTS[0] + "; exec " + shlex.join(argv)
        return ["ip", "netns", "exec", self.namespaces[0], "unshare", "--uts", "bash", "-c",
                inner]

    def drop_ports(self, low: int, mask: int) -> None:
        """Drop every TCP packet to ports ``low`` .. ``low | ~mask`` on both hosts (a firewall).

        ``mask`` selects the port bits that must match ``low`` (0xfff0: 16 ports).
        """
        for ns, link in zip(self.namespaces, self.links, strict=True):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "ingress")
            _run("ip", "netns", "exec", ns, "tc", "filter", "add", "dev", link, "parent",
                 "ffff:", "protocol", "ip", "u32", "match", "ip", "protocol", "6", "0xff",
                 "match", "ip", "dport", str(low), hex(mask), "action", "drop")

    def link_bytes(self) -> tuple[int, int]:
        """Bytes that left host A and host B through the link so far.

        ``tc -s``'s count; on the user-space link its own, of the frames it delivered.
        """
        if self.forwarder is not None:
            a_to_b, b_to_a, _ = self.forwarder.counts()
            return a_to_b, b_to_a
        out = []
        for ns, link in zip(self.namespaces, self.links, strict=True):
            stats = _run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", link)
            words = stats.stdout.split()
            out.append(int(words[words.index("Sent") + 1]) if "Sent" in words else 0)
        return out[0], out[1]


__all__ = ["HOSTS", "TwoHosts", "available", "netem_available", "set_up", "tcp_mpirun"]
