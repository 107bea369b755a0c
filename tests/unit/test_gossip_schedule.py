"""The gossip pairing protocol without processes: ready ring neighbours pair up mutually.

The board is the one-sided counter of the comm layer in the real run; here an in-process
stand-in with the same atomic compare-and-swap runs the very ``_pair`` code of the thread.
"""

import collections
import random
import threading
import time

import pytest
import torch

from hadpsgd.algorithms.gossip import CLOSED, GossipThread, neighbours


class Board:
    """Slots with atomic compare-and-swap (what SharedCounter gives over MPI)."""

    def __init__(self, n: int) -> None:
        self.slots = [0] * n
        self.lock = threading.Lock()

    def compare_and_swap(self, slot: int, expected: int, new: int) -> int:
        with self.lock:
            old = self.slots[slot]
            if old == expected:
                self.slots[slot] = new
            return old

    def get(self, slot: int) -> int:
        with self.lock:
            return self.slots[slot]


class Channel:
    def __init__(self, rank: int, size: int, board: Board) -> None:
        self.rank, self.size, self._board = rank, size, board
        self.watchdog = None
        self.world_ranks = list(range(size))

    def board(self, slots: int) -> Board:
        return self._board

    def on_device(self, t: torch.Tensor) -> bool:
        return False  # no host group: the gossip's buffers are host ones


def test_neighbours_on_rings():
    assert neighbours(0, 1) == []
    assert neighbours(0, 2) == [1] and neighbours(1, 2) == [0]
    assert neighbours(0, 5) == [1, 4] and neighbours(3, 5) == [2, 4]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_pairings_are_mutual_ring_neighbours_and_a_slow_one_is_not_waited_for(n):
    board = Board(n)
    threads = [GossipThread(torch.zeros(3), threading.Lock(), Channel(i, n, board))
               for i in range(n)]
    seen: dict[int, list[int]] = collections.defaultdict(list)

    def work(i: int) -> None:
        rng = random.Random(i)
        # As in the thread's loop: pair until closing (set by the "main thread" below); a
        # pairing that comes while closing is still served.
        while (p := threads[i]._pair()) is not None:
            seen[i].append(p)
            # node 0 is slow between its pairings; the others are quick
            time.sleep(0.02 if i == 0 else rng.uniform(0, 0.002))
        assert board.compare_and_swap(i, 0, CLOSED) == 0

    workers = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    time.sleep(0.5)
    for t in threads:
        t._closing = True
    for w in workers:
        w.join(10)
        assert not w.is_alive(), "a leader never got off the board"
    pairs = collections.Counter((i, p) for i, ps in seen.items() for p in ps)
    for (i, p), count in pairs.items():
        assert p in neighbours(i, n)
        assert pairs[(p, i)] == count  # every pairing is seen from both sides
    if n >= 3:  # the fast ones paired far more often than the slow one's pace allows
        assert len(seen[2]) > 2 * len(seen[0])
