"""Worker: the comm_ops checks with the cross-node leg cut by host (gloo standing in for NCCL).

See ``_standin.py``: ``HOST_LINK_HOSTS=k`` spreads the super-learners over k pretend hosts,
so the host leaders' MPI leg runs too. With super-learners of one, the side channel of
BMUF's block average gets its own twin link where its means run on the caller's thread, and
none where a background thread runs them (only one thread launches NCCL: comm/hostlink.py),
checked first. Prints ``link rank r ...`` (and ``side rank r ok True``).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import _standin  # noqa: E402 - the workers' folder, above


def side_channel(topo: object) -> None:
    if max(topo.node_sizes) > 1:  # BMUF-Adam's layout only: the overlapped average's channel
        return
    ok = True
    for background in (False, True):
        side = topo.side_channel("fp32", background=background)
        t = torch.full((1001,), float(topo.node + 1))  # the mean of 1..N: exact in fp32
        side.wait(side.submit(lambda s=side, t=t: s.mean_("pack", t), "side mean", uses=[t]))
        linked = side.link is not None and side.link.calls == 1
        ok &= (linked != side.background  # the twin on the caller's thread, MPI beside it
               and torch.equal(t, torch.full_like(t, (topo.num_nodes + 1) / 2)))
        side.close()
    print(f"side rank {topo.rank} ok {ok}", flush=True)


done = _standin.run("comm_ops.py", [], after=side_channel)
link = _standin.made[0]
print(f"link rank {done['r']} hosts {link.hosts} calls {link.calls} "
      f"group {link.local.size if link.local else 1} leader {link.leaders is not None} "
      f"shard {link.shards is not None}",
      flush=True)
