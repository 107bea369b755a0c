"""A user's script whose rank 1 ends differently from the others (issue 55, items 2 and 3).

``argv[1]``: ``deadlock`` (rank 1 takes one ``threading.Lock`` twice after
``hadpsgd.init()``; the others print and end), ``exit N`` (rank 1 calls ``sys.exit(N)``
while the others enter an allreduce it never joins) or ``ok`` (every rank ends with
``sys.exit(0)`` after the allreduce: the normal end, also through ``sys.exit``).
"""

from __future__ import annotations

import sys
import threading

import torch

import hadpsgd

mode = sys.argv[1]
topo = hadpsgd.init()
if mode == "deadlock" and topo.rank == 1:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns
if mode == "exit" and topo.rank == 1:
    sys.exit(int(sys.argv[2]))
if mode != "deadlock":
    total = topo.allreduce_(torch.ones(3), op="sum")
    assert total.tolist() == [topo.size] * 3, total
print(f"rank {topo.rank}: done", flush=True)
if mode == "ok":
    sys.exit(0)
