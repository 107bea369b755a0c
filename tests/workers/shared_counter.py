"""Worker: the one-sided shared counter. Ranks take tickets at different paces; every ticket
is handed out exactly once, accumulations sum over ranks, reset sets every slot. Then the
pairing board's slots each in its own rank (OwnedSlots): every rank claims its right
neighbour's slot once, and counts 24 bytes for it, none for its own slot."""

import sys
import time

from hadpsgd import comm
from hadpsgd.comm.counter import OwnedSlots

topo = comm.init(preload=False)  # no optimizer steps here
c = topo.shared_counter(3)
got = []
while (t := c.take(0)) < 40:
    got.append(t)
    time.sleep(0.002 * (1 + 4 * (topo.rank == 1)))  # rank 1 is five times slower
c.add([topo.rank + 1, 5], first=1)
topo.barrier()
totals = c.read()
everyone = topo.allgather_object(got)
failures = []
if sorted(x for g in everyone for x in g) != list(range(40)):
    failures.append(f"tickets not handed out exactly once: {everyone}")
if len(everyone[1]) >= min(len(g) for r, g in enumerate(everyone) if r != 1):
    failures.append(f"the slow rank took as many tickets as a fast one: {everyone}")
if list(totals[1:]) != [sum(r + 1 for r in range(topo.size)), 5 * topo.size]:
    failures.append(f"accumulated totals wrong: {totals}")
c.reset([7, 0, 0])
if list(c.read()) != [7, 0, 0]:
    failures.append("reset did not set the slots")
topo.barrier()
c.free()

board = OwnedSlots(topo.comm.Dup(), topo.watchdog)
right = (topo.rank + 1) % topo.size
board.compare_and_swap(topo.rank, 0, 1)  # on the board: its own memory, crosses nothing
own_bytes = board.crossing_bytes
topo.barrier()
won = board.compare_and_swap(right, 1, 16 + topo.rank)  # claim the right neighbour
topo.barrier()
mine = board.get(topo.rank)
if won != 1 or mine != 16 + (topo.rank - 1) % topo.size:
    failures.append(f"board: claim found {won}, own slot holds {mine}")
if own_bytes != 0 or board.crossing_bytes != 24:  # the claim; its own slot's read: none
    failures.append(f"board counted {own_bytes} then {board.crossing_bytes} bytes")
topo.barrier()
board.free()
topo.close()
if failures:
    print(f"FAIL rank {topo.rank}: {failures}", flush=True)
    sys.exit(1)
print(f"OK rank {topo.rank} took {len(got)}", flush=True)
