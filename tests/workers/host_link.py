"""Worker: the comm_ops checks with the cross-node leg cut by host (gloo standing in for NCCL).

``comm.init`` is wrapped so that, once the topology is built, a :class:`HostLink` whose host
groups are gloo groups (NCCL's twin, :class:`~hadpsgd.comm.backends.TorchIntra`) takes every
host tensor's cross-node leg, as NCCL takes device tensors between super-learners that share
a GPU host. ``HOST_LINK_HOSTS=k`` spreads the super-learners over k pretend hosts (nodes in
consecutive blocks), so the host leaders' MPI leg runs too. With super-learners of one, the
side channel of BMUF's overlapped average gets its own twin link, checked first. Prints
``link rank r ...`` (and ``side rank r ok True``).
"""

import os
import runpy
import sys

import torch

from hadpsgd import comm
from hadpsgd.comm.backends import GlooIntra
from hadpsgd.comm.hostlink import SCOPE, HostLink

real_init = comm.init
made: list[HostLink] = []


def init(**kwargs: object) -> comm.Topology:
    topo = real_init(**kwargs)  # type: ignore[arg-type]
    hosts = int(os.environ.get("HOST_LINK_HOSTS", "1"))
    per_host = -(-topo.num_nodes // hosts)
    node_of = {r: i for i, r in enumerate(topo.inter_ranks)}  # inter rank i is node i
    link = HostLink.build(
        topo.inter, topo.watchdog, topo.inter_ranks,
        [node_of[r] // per_host for r in topo.inter_ranks], "cpu", "gloo",
        lambda c, guard, members: GlooIntra(c, guard, members, scope=SCOPE))
    topo.reducer.host_link = link
    topo.reducer._plans.clear()  # the direct plans are made knowing the link
    made.append(link)
    if max(topo.node_sizes) == 1:  # BMUF-Adam's layout: the overlapped average's channel too
        side = topo.side_channel("fp32", background=True)
        t = torch.full((1001,), float(topo.node + 1))  # the mean of 1..N: exact in fp32
        side.wait(side.submit(lambda: side.mean_("pack", t), "side mean", uses=[t]))
        ok = (side.link is not None and side.link.calls == 1
              and torch.equal(t, torch.full_like(t, (topo.num_nodes + 1) / 2)))
        print(f"side rank {topo.rank} ok {ok}", flush=True)
        side.close()
    return topo


comm.init = init
sys.argv = [os.path.join(os.path.dirname(__file__), "comm_ops.py")]
done = runpy.run_path(sys.argv[0], run_name="__main__")
link = made[0]
print(f"link rank {done['r']} hosts {link.hosts} calls {link.calls} "
      f"group {link.local.size if link.local else 1} leader {link.leaders is not None}",
      flush=True)
