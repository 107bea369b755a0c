"""Two sites of hosts on one machine: a slow link between the sites, a fast one inside each.

:class:`benchmarks._common.netns.TwoHosts` has one link, so it cannot tell a site's own
network from the link between sites. Here every host is a network namespace with its own
host name, joined to one switch (a Linux bridge in a namespace of its own); each host's
egress queue is an HTB with two classes: traffic to the hosts of the *other* site goes
through class ``1:20`` at ``rate`` (the inter-site link, e.g. 100 Mbit/s between two
universities), everything else through ``1:10`` unthrottled (the site's own network). The
classes' counters (``tc -s class``) are the bytes each way, so a run's bytes between sites
and inside them are read apart. MPI runs over TCP between all hosts, shared memory inside
one; Open MPI's ``mpirun`` starts in the first host and reaches the others through an
agent that enters their namespaces (as ``TwoHosts`` does). Root, ``ip``, ``tc``,
``unshare`` and Open MPI are needed: :func:`benchmarks._common.netns.available`. ::

    with Sites(hosts_per_site=2, rate="100mbit") as sites:
        subprocess.run(sites.mpirun(4, [sys.executable, "-m", "hadpsgd.run", ...]))
        between, inside = sites.link_bytes()
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from benchmarks._common.netns import _run, set_up, tcp_mpirun

FAST = "10gbit"
"""The site's own network (the HTB class needs a rate: far above what 2 cores send)."""


class Sites:
    """``sites`` sites of ``hosts_per_site`` emulated hosts (a context manager).

    Hosts are named ``site{s}host{h}`` and numbered site by site: ranks placed on them in
    order (``mpirun``'s ``--map-by slot``) fill site 0 first, so ``--ranks-per-node`` equal
    to a site's ranks makes every super-learner one site.

    Args:
        sites: Sites (at least 2).
        hosts_per_site: Hosts in each site.
        rate: The inter-site link's rate each way, in tc's units (``100mbit``).
        env: Environment variables forwarded to every rank (``mpirun -x``), besides
            ``PYTHONPATH``, ``OMP_NUM_THREADS`` and every ``HADPSGD_*`` set.
    """

    def __init__(self, sites: int = 2, hosts_per_site: int = 2, rate: str = "100mbit",
                 env: dict[str, str] | None = None) -> None:
        if sites < 2 or hosts_per_site < 1:
            raise ValueError(f"need at least 2 sites of at least 1 host, got {sites} x "
                             f"{hosts_per_site}")
        tag = os.getpid() % 200 + 20
        self.sites, self.hosts_per_site, self.rate = sites, hosts_per_site, rate
        count = sites * hosts_per_site
        self.hosts = [f"site{i // hosts_per_site}host{i % hosts_per_site}"
                      for i in range(count)]
        """Host names, site by site."""
        self.namespaces = [f"hs{os.getpid()}n{i}" for i in range(count)]
        self.switch = f"hs{os.getpid()}sw"
        self.links = [f"hs{tag}h{i}" for i in range(count)]
        self.ports = [f"hs{tag}p{i}" for i in range(count)]
        self.addresses = [f"10.78.{tag}.{10 + i}" for i in range(count)]
        self.subnet = f"10.78.{tag}.0/24"
        self.env = dict(env or {})
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def site_of(self, host: int) -> int:
        """The site of host number ``host``."""
        return host // self.hosts_per_site

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> Sites:
        return set_up(self, "emulated sites")

    def _create(self) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, link, port, addr) in enumerate(zip(self.namespaces, self.links, self.ports,
                                                       self.addresses, strict=True)):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", link, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", link, "netns", ns)
            _run("ip", "link", "set", port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(i)
        self._dir = tempfile.TemporaryDirectory(prefix="hadpsgd-sites-")
        # mpirun starts the daemons of the other hosts through this agent (in place of ssh).
        cases = "".join(f"  {shlex.quote(h)}) ns={shlex.quote(n)};;\n"
                        for h, n in zip(self.hosts, self.namespaces, strict=True))
        agent = Path(self._dir.name) / "agent.sh"
        agent.write_text(
            "#!/bin/bash\n"
            "# mpirun's remote-launch agent: enter the host's namespace under its host name.\n"
            'host="$1"; shift\n'
            f'case "$host" in\n{cases}  *) echo "no emulated host $host" >&2; exit 1;;\nesac\n'
            'exec ip netns exec "$ns" unshare --uts bash -c "hostname $host; $*"\n')
        agent.chmod(0o755)

    def _shape(self, host: int) -> None:
        """Host ``host``'s egress: to the other sites at :attr:`rate`, the rest unthrottled."""
        ns, link = self.namespaces[host], self.links[host]

        def tc(*args: str) -> None:
            _run("ip", "netns", "exec", ns, "tc", *args)

        tc("qdisc", "add", "dev", link, "root", "handle", "1:", "htb", "default", "10")
        tc("class", "add", "dev", link, "parent", "1:", "classid", "1:10", "htb", "rate", FAST)
        tc("class", "add", "dev", link, "parent", "1:", "classid", "1:20", "htb", "rate",
           self.rate, "burst", "64kb")
        for other, addr in enumerate(self.addresses):
            if self.site_of(other) != self.site_of(host):
                tc("filter", "add", "dev", link, "parent", "1:", "protocol", "ip", "prio", "1",
                   "u32", "match", "ip", "dst", f"{addr}/32", "flowid", "1:20")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace (the links go with them) and the agent; idempotent."""
        for ns in [*self.namespaces, self.switch]:
            _run("ip", "netns", "del", ns, check=False)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # ------------------------------------------------------------------ use
    def mpirun(self, nprocs: int, argv: list[str]) -> list[str]:
        """The command that runs ``argv`` on ``nprocs`` ranks, the same number on each host."""
        count = len(self.hosts)
        if nprocs < count or nprocs % count:
            raise ValueError(f"nprocs must be a multiple of the {count} hosts, got {nprocs}")
        if self._dir is None:
            raise RuntimeError("use Sites as a context manager (with Sites() as s: ...)")
        per = nprocs // count
        cmd = tcp_mpirun(nprocs, ",".join(f"{h}:{per}" for h in self.hosts),
                         str(Path(self._dir.name) / "agent.sh"), self.subnet, self.env, argv)
        inner = "hostname " + self.hosts[0] + "; exec " + shlex.join(cmd)
        return ["ip", "netns", "exec", self.namespaces[0], "unshare", "--uts", "bash", "-c",
                inner]

    def link_bytes(self) -> tuple[int, int]:
        """Bytes sent so far between sites and inside them (every host's queue, summed)."""
        between = inside = 0
        for ns, link in zip(self.namespaces, self.links, strict=True):
            stats = _run("ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", link)
            for block in stats.stdout.split("class htb ")[1:]:
                words = block.split()
                sent = int(words[words.index("Sent") + 1]) if "Sent" in words else 0
                if words[0] == "1:20":
                    between += sent
                elif words[0] == "1:10":
                    inside += sent
        return between, inside


__all__ = ["Sites"]
