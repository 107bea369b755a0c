"""The in-process world (:mod:`hadpsgd.comm.threads`): learners as threads.

Held to the :class:`~hadpsgd.comm.World` face as ``Topology`` is (``test_world.py``), its
collectives checked against sums written here, a failing learner ending the job instead of
hanging it, and the first algorithm property moved onto it: SSGD on N learners equals one
learner with N times the batch (the h-adpsgd paper's premise; ``tests/mpi/test_ssgd.py``
keeps it through the main command under mpirun).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hadpsgd.algorithms import BMUF, SSGD
from hadpsgd.comm import CommTimeoutError, World
from hadpsgd.comm.threads import ThreadJob, ThreadWorld
from tests.unit.test_world import face_gaps


def test_a_thread_world_has_every_member_of_the_face_with_its_parameters() -> None:
    world = ThreadWorld(ThreadJob(4, 2), 3)
    assert face_gaps(ThreadWorld, lambda n: hasattr(world, n)) == []
    assert (world.node, world.local_rank, world.num_nodes, world.local_size) == (1, 1, 2, 2)


@pytest.mark.parametrize(("size", "per_node"), [(1, 1), (3, 1), (4, 2), (6, 3)])
def test_collectives_against_sums_written_here(size: int, per_node: int) -> None:
    def value(rank: int) -> torch.Tensor:
        return torch.arange(5, dtype=torch.float64) * (rank + 1) + rank  # exact sums

    def learner(w: World) -> dict:
        out = {}
        t = value(w.rank)
        out["sum"] = w.allreduce_(t.clone(), op="sum")
        out["avg"] = w.allreduce_(t.clone())
        out["node"] = w.intra_allreduce_(t.clone(), op="sum")
        out["across"] = w.inter_allreduce_(t.clone(), op="sum")
        out["bcast"] = w.broadcast_(t.clone(), root=size - 1)
        out["node_bcast"] = w.intra_broadcast_(t.clone(), root=per_node - 1)
        out["objects"] = w.allgather_object({"rank": w.rank})
        out["root_obj"] = w.bcast_object(f"from {w.rank}", root=0)
        out["gathered"] = w.gather_object(w.rank, root=0)
        w.barrier()
        return out

    results = ThreadJob(size, per_node).run(learner)
    every = [value(r) for r in range(size)]
    for r, got in enumerate(results):
        node, local = divmod(r, per_node)
        mates = range(node * per_node, (node + 1) * per_node)
        across = range(local, size, per_node)
        assert torch.equal(got["sum"], sum(every))
        assert torch.equal(got["avg"], sum(every) / size)
        assert torch.equal(got["node"], sum(every[m] for m in mates))
        assert torch.equal(got["across"], sum(every[a] for a in across))
        assert torch.equal(got["bcast"], every[size - 1])
        assert torch.equal(got["node_bcast"], every[mates[-1]])
        assert got["objects"] == [{"rank": k} for k in range(size)]
        assert got["root_obj"] == "from 0"
        assert got["gathered"] == (list(range(size)) if r == 0 else None)


def test_a_failing_learner_ends_the_job_with_its_error_and_nobody_hangs() -> None:
    def learner(w: World) -> None:
        if w.rank == 2:
            raise ValueError("learner 2's own mistake")
        w.allreduce_(torch.ones(3))  # the others wait here for learner 2

    with pytest.raises(ValueError, match="learner 2's own mistake"):
        ThreadJob(4, timeout=30).run(learner)


def test_a_collective_one_learner_skips_is_named_at_the_deadline() -> None:
    def learner(w: World) -> None:
        if w.rank != 1:
            w.barrier()

    with pytest.raises(CommTimeoutError, match="never arrived"):
        ThreadJob(3, timeout=0.5).run(learner)


def test_the_side_channel_runs_beside_the_learners_own_collectives() -> None:
    """BMUF's side channel on threads (the MPI world's ``SideChannel`` and ``CompressedMean``
    over meetings of groups of its own): a background mean of each node's tensor crosses
    the nodes while every learner makes its own world allreduce, the fp32 mean exact, the
    int8 one within its rounding, each the same bits on every learner; a learner that never
    submits is named at the deadline instead of hanging the others."""
    def learner(w: World) -> tuple[list[float], list[float], bool]:
        got = []
        for wire in ("fp32", "int8"):
            side = w.side_channel(wire, background=True)
            t = torch.linspace(-1.0, 1.0, 37) * (w.node + 1)  # the same inside a node
            job = side.submit(lambda side=side, t=t: side.mean_("x", t), "test mean")
            mine = torch.full((3,), float(w.rank))
            w.allreduce_(mine)  # the learner's own collective while the mean is in flight
            side.wait(job)
            background = side.background
            side.close()
            assert mine.tolist() == [1.5] * 3
            got.append(t.tolist())
        return got[0], got[1], background

    every = ThreadJob(4, 2, timeout=30).run(learner)
    exact = (torch.linspace(-1.0, 1.0, 37) * 1.5).tolist()
    assert all(e[0] == exact and e[1] == every[0][1] and e[2] for e in every)
    assert max(abs(a - b) for a, b in zip(every[0][1], exact, strict=True)) < 1.5 / 127

    def one_never_submits(w: World) -> None:
        side = w.side_channel("int8", background=False)
        if w.rank != 1:
            side.mean_("x", torch.ones(8))

    with pytest.raises(CommTimeoutError, match="never arrived"):
        ThreadJob(2, timeout=0.5).run(one_never_submits)


def test_the_bf16_wire_and_what_needs_no_pipeline() -> None:
    """``half_mean_`` across 2 nodes of 2: the world's mean within one bf16 rounding, the
    same bits everywhere, and only the inter-node leg's bytes counted (each local rank sends
    half its slice, 2 bytes a value); no gradient pipeline, nothing deferred."""
    def learner(w: World) -> tuple[list[float], int]:
        t = torch.arange(8, dtype=torch.float32) * (w.rank + 1)
        sent = w.half_mean_(t, "world")
        assert w.grad_pipeline() is None and not w.deferrable("world")
        return t.tolist(), sent

    every = ThreadJob(4, 2, timeout=30).run(learner)
    want = torch.arange(8, dtype=torch.float64) * 2.5
    assert all(e == every[0] for e in every)
    assert torch.allclose(torch.tensor(every[0][0], dtype=torch.float64), want, rtol=2**-8)
    assert every[0][1] == 2 * (2 - 1) * 2 * 2  # slice of 4 values, a shard of 2 per node


def test_shared_counters_hand_out_each_ticket_once() -> None:
    # 4 learners take 50 tickets each from one slot, one-sidedly: every ticket once.
    def learner(w: World) -> tuple[list[int], list[int]]:
        pool = w.shared_counter(2)
        mine = [pool.take(0) for _ in range(50)]
        w.barrier()
        assert pool.read().tolist() == [200, 0]
        pool.reset([5, 6])  # collective: every learner sees it after
        assert pool.get(0) == 5
        w.barrier()
        old = pool.add([1, 1]).tolist()  # one-sided: each learner's old values differ
        pool.free()
        return mine, old

    results = ThreadJob(4).run(learner)
    assert sorted(sum((m for m, _ in results), [])) == list(range(200))
    assert sorted(old for _, old in results) == [[5, 6], [6, 7], [7, 8], [8, 9]]


def test_the_pair_channel_swaps_buffers_and_meets_at_its_barrier() -> None:
    # 2 super-learners of 2: the leaders' channel has ranks 0 and 1 (the node index); they
    # swap twice on one tag (in order), and a non-blocking barrier completes when both start.
    def learner(w: World) -> list[float]:
        channel = w.pair_channel()
        if w.local_rank != 0:
            return []
        assert (channel.rank, channel.size) == (w.node, 2)
        got = []
        for k in range(2):
            recv = torch.empty(3)
            channel.exchange(torch.full((3,), 10.0 * w.node + k), recv, 1 - channel.rank)
            got.append(float(recv[0]))
        board = channel.board(2)
        board.compare_and_swap(channel.rank, 0, 7)
        barrier = channel.start_barrier()
        channel.watchdog.wait_until(barrier.done, "test barrier", None)
        board.free()
        return got

    results = ThreadJob(4, 2).run(learner)
    assert results[0] == [10.0, 11.0] and results[2] == [0.0, 1.0]


def test_adpsgd_gossip_on_threads_conserves_the_sum_of_replicas() -> None:
    # ADPSGD's own gossip thread on the thread world's pair channel: 4 learners on a ring,
    # constant gradients; the replicas' sum is n w0 - lr sum_r T_r g_r (Eqs. 6-7: gossip
    # moves none of it), and exchanges happened. A learner whose thread has not exchanged
    # yet after 30 steps goes on stepping (up to 20 s): on a loaded machine all 30 steps
    # once ended before any pairing (gossip is paced by the steps), so each counts its own.
    import time

    from hadpsgd.algorithms import ADPSGD

    lr, steps = 0.05, 30

    def learner(w: World) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        model = torch.nn.Linear(8, 3).double()
        algo = ADPSGD(model, torch.optim.SGD(model.parameters(), lr=lr), w, gossip_jitter=0.002)
        w0 = algo.flat.clone()
        g = torch.full_like(algo.flat, 0.01 * (w.rank + 1))
        done, until = 0, time.monotonic() + 20
        while done < steps or (algo.thread and not algo.thread.exchanges
                               and time.monotonic() < until):
            algo.grads.buffers[torch.float64].copy_(g)
            algo.step()
            algo.grads.zero_()
            done += 1
        exchanges = algo.thread.exchanges if algo.thread else 0
        algo.close()
        return algo.flat.clone(), w0, exchanges, done

    results = ThreadJob(4, timeout=60).run(learner)
    total = sum(r[0] for r in results)
    w0 = results[0][1]  # the broadcast start, the same on every learner
    expected = 4 * w0 - lr * sum(0.01 * (k + 1) * r[3] for k, r in enumerate(results))
    assert float((total - expected).norm() / expected.norm()) < 1e-9
    assert sum(r[2] for r in results) > 0


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 6, generator=gen), torch.randn(rows, 4, generator=gen)


@pytest.mark.parametrize(("size", "per_node"), [(2, 1), (4, 1), (4, 2)])
def test_ssgd_on_n_learners_equals_one_learner_with_n_times_the_batch(size: int,
                                                                      per_node: int) -> None:
    b, steps, start = 3, 5, _model()

    def train(w: World, model: torch.nn.Module, rows: int) -> list[torch.Tensor]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        algo = SSGD(model, opt, w)
        for step in range(steps):
            x, y = _batch(step, size * b)
            mine = slice(w.rank * rows, (w.rank + 1) * rows)  # this learner's shard
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            algo.step()
            algo.zero_grad()
        algo.close()
        return [p.detach().clone() for p in model.parameters()]

    models = [copy.deepcopy(start) for _ in range(size)]
    many = ThreadJob(size, per_node).run(lambda w: train(w, models[w.rank], b))
    one = ThreadJob(1).run(lambda w: train(w, copy.deepcopy(start), size * b))[0]
    for replica in many:  # every replica the same bits
        assert all(torch.equal(p, q) for p, q in zip(replica, many[0], strict=True))
    for p, q, s in zip(many[0], one, start.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p - q).abs().max()
        assert not torch.allclose(p, s.detach())  # the steps moved the model


def test_bmuf_replicas_of_a_super_learner_agree_and_every_sync_leaves_one_global_model() -> None:
    # 2 super-learners of 2 on different data, tau 3, 7 steps: the members of a node hold the
    # same bits after every step, and right after each block sync every learner evaluates the
    # same global model.
    start = _model()

    def learner(w: World) -> list[bool]:
        model = copy.deepcopy(start)
        algo = BMUF(model, torch.optim.SGD(model.parameters(), lr=0.05), w, sync_period=3)
        seen = []
        for step in range(7):
            x, y = _batch(10 * w.node + step, 4)  # the node's data
            torch.nn.functional.mse_loss(model(x), y).backward()
            algo.step()
            algo.zero_grad()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            seen.append(len({tuple(t.tolist()) for t in w.allgather_object(flat)
                              [w.node * 2:(w.node + 1) * 2]}) == 1)
        algo.sync()
        with algo.evaluation_parameters() as evaluated:
            flat = torch.cat([p.detach().reshape(-1) for p in evaluated.parameters()])
        seen.append(len({tuple(t.tolist()) for t in w.allgather_object(flat)}) == 1)
        algo.close()
        return seen

    assert all(all(r) for r in ThreadJob(4, 2).run(learner))
