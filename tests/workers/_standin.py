"""gloo standing in for NCCL between super-learners that share a host (issue 44 item 3).

:func:`install` wraps ``comm.init`` so that, once a topology is built, a
:class:`~hadpsgd.comm.hostlink.HostLink` whose host groups are gloo groups (NCCL's twin,
:class:`~hadpsgd.comm.backends.TorchIntra`) takes every host tensor's cross-node leg, as
NCCL takes device tensors where super-learners share a GPU host; a side channel made after
it whose means run on the caller's thread builds its own twin from it (a background thread's
channel, and the gossip's, take MPI: one thread launches NCCL). ``hosts``
spreads the super-learners over that many pretend hosts, nodes in consecutive blocks.
"""

import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

from hadpsgd import comm
from hadpsgd.comm.backends import GlooIntra
from hadpsgd.comm.hostlink import SCOPE, HostLink

made: list[HostLink] = []
"""The links installed, in order (one per ``comm.init``)."""


def install(hosts: int, after: object = None) -> Callable[[], None]:
    """Wrap ``comm.init``; ``after(topo)``, if given, runs once the link is in place.

    Returns what puts ``comm.init`` back: a warm world's process (tests/_commands.py) runs
    the next command after this one, which must meet the real ``comm.init``.
    """
    real_init = comm.init
    made.clear()

    def init(**kwargs: object) -> comm.Topology:
        topo = real_init(**kwargs)  # type: ignore[arg-type]
        per_host = -(-topo.num_nodes // hosts)
        node_of = {r: i for i, r in enumerate(topo.inter_ranks)}  # inter rank i: node i
        link = HostLink.build(
            topo.inter, topo.watchdog, topo.inter_ranks,
            [node_of[r] // per_host for r in topo.inter_ranks], "cpu", "gloo",
            lambda c, guard, members: GlooIntra(c, guard, members, scope=SCOPE))
        topo.reducer.host_link = link
        topo.reducer._plans.clear()  # the direct plans are made knowing the link
        made.append(link)
        if after is not None:
            after(topo)  # type: ignore[operator]
        return topo

    comm.init = init

    def restore() -> None:
        comm.init = real_init

    return restore


def run(worker: str, args: list[str], after: object = None) -> dict[str, Any]:
    """Run the worker ``worker`` of this folder with ``args`` under the stand-in (on
    ``HOST_LINK_HOSTS`` pretend hosts, default 1); its globals when it ends. ``comm.init`` is
    put back whatever happened."""
    restore = install(int(os.environ.get("HOST_LINK_HOSTS", "1")), after)
    try:
        sys.argv = [os.path.join(os.path.dirname(__file__), worker), *args]
        return runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        restore()
