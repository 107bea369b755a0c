"""The comm layer's streams on a GPU: gradient buckets, side jobs, copies, one-chunk staging.

Skipped without CUDA. In-process checks (no MPI) that each path runs on its own stream, is
ordered after the work it reads (a long kernel queued first on the compute stream would
otherwise be overtaken), does not hold up the host or the compute stream, and uses pinned
host buffers; and mpirun checks that training through them gives what the blocking paths
give. The same ordering is checked against a fake ``torch.cuda`` on the CPU in
``tests/unit/test_comm_streams.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests._mpi import assert_ok, run_mpi

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
four_gpus = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")

SLEEP_CYCLES = 1_000_000_000
"""A kernel of about half a second (``torch.cuda._sleep``): work still running when the host
goes on (a host that waited for it would take longer than :data:`HOST_S`)."""
HOST_S = 0.2
"""Seconds the host may take to queue work behind such a kernel without waiting for it."""


def _busy() -> None:
    """Queue a long kernel on the current stream (what a copy must not overtake)."""
    torch.cuda._sleep(SLEEP_CYCLES)


def test_one_chunk_staging_is_the_pipelines_result_on_the_callers_stream():
    from hadpsgd.comm.staging import Stager

    stager = Stager()
    t = torch.zeros(1000, device="cuda")
    pinned = []

    def op(buf: torch.Tensor) -> None:
        pinned.append(buf.is_pinned())
        buf.add_(1)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _busy()
        t.fill_(2)  # still queued when the copy off the device is: it must come after
        stager.run_staged(t, op)
    torch.cuda.current_stream().wait_stream(side)
    assert pinned == [True] and not stager._streams  # no side stream for one chunk
    assert torch.equal(t.cpu(), torch.full((1000,), 3.0))
    piped = torch.full((1000,), 2.0, device="cuda", dtype=torch.bfloat16)
    whole = piped.clone()
    Stager().run_staged(piped, op, chunk_elems=300)
    Stager().run_staged(whole, op)
    assert torch.equal(piped.cpu(), whole.cpu()) and whole.dtype == torch.bfloat16


def test_copy_stream_snapshot_sees_the_last_write_and_the_next_write_waits_for_it():
    from hadpsgd.comm.copies import CopyStream

    x = torch.zeros(1 << 20, device="cuda")
    copies = CopyStream(x.device)
    out = copies.host(x.numel(), x.dtype)
    assert out.is_pinned() and copies.stream != torch.cuda.current_stream()
    with copies.writing():
        _busy()
        x.fill_(1)
    began = time.perf_counter()
    copies.fetch(x, out)
    with copies.writing():
        x.fill_(2)  # queued behind the snapshot's copy, on the device
    queued = time.perf_counter() - began
    copies.wait()
    assert queued < HOST_S, f"fetch or writing() waited on the host for {queued:.3f} s"
    assert bool(out.eq(1).all())
    torch.cuda.synchronize()
    assert bool(x.eq(2).all())
    host = copies.host(x.numel(), x.dtype).fill_(5)
    dst = torch.zeros_like(x)
    copies.upload(host, dst)
    copies.arrived()
    assert float(dst.sum()) == 5 * x.numel()


def test_background_buckets_wait_for_their_gradients_not_the_compute_stream():
    from hadpsgd.comm.overlap import BucketPlan, BucketReducer

    plan = BucketPlan([(torch.float32, 4096 * i, 4096) for i in range(4)], 4096 * 4)
    buf = torch.zeros(4 * 4096, device="cuda")
    streams: list[Any] = []

    def reduce(view: torch.Tensor, scope: str) -> None:
        streams.append(torch.cuda.current_stream())
        view.mul_(2)

    red = BucketReducer(plan, {torch.float32: buf}, reduce, lambda: "world",
                        lambda v: v.sum(), background=True, timeout=30.0)
    try:
        assert red._events is not None
        for step in range(2):
            _busy()
            buf.fill_(step + 1)  # backward's gradients, still queued on the compute stream
            for i in reversed(range(4)):
                red.param_ready(i)
            sums = red.finish()
            assert all(s == red._events.stream for s in streams)
            assert all(s != torch.cuda.current_stream() for s in streams)
            assert torch.equal(buf.cpu(), torch.full((4 * 4096,), 2.0 * (step + 1)))
            assert [float(s) for s in sums] == [4096.0 * (step + 1)] * 4
    finally:
        red.close()


class _OneNode:
    """What a side channel needs of a communicator when only jobs are run."""

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return 1


class _Watchdog:
    timeout = 30.0

    def stop(self) -> None:
        pass


def test_side_jobs_run_on_their_stream_and_the_waiter_waits_for_them():
    from hadpsgd.comm.side import SideChannel

    side = SideChannel(_OneNode(), _Watchdog(), [0], "fp32", background=True)  # type: ignore[arg-type]
    try:
        pack = torch.zeros(1 << 20, device="cuda")
        seen: list[Any] = []

        def job() -> None:
            seen.append(torch.cuda.current_stream())
            pack.add_(1)

        _busy()
        pack.fill_(1)  # the block's packing, still queued: the job must read it
        began = time.perf_counter()
        handle = side.submit(job, "test job", uses=[pack])
        side.wait(handle)
        pack.mul_(3)  # on the waiter's stream, after the job's add
        assert time.perf_counter() - began < HOST_S  # the host waited for neither kernel
        assert seen and seen[0] != torch.cuda.current_stream()
        assert bool(pack.eq(6).all())
    finally:
        side.close()


TRAIN = """
import hashlib, sys
import torch
from hadpsgd import comm
from hadpsgd.algorithms import build

mode = sys.argv[1]
topo = comm.init(device="cuda")
if topo.rank == 0:
    print(topo.describe(), flush=True)

def digest(t):
    return hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()

if mode == "grads":  # the gradient buckets: overlapped on the comm stream vs after backward
    runs = []
    for overlap in ("on", "off"):
        torch.manual_seed(0)
        # Linear layers (cuBLAS on one stream: deterministic), several buckets of them.
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
            torch.nn.Linear(32, 5)).to(topo.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        algo = build("ssgd", model, opt, topo, overlap=overlap, grad_bucket_mb=0.001)
        if overlap == "on" and topo.thread_multiple:
            assert algo.gradsync.reducer._events is not None, "no comm stream"
        gen = torch.Generator().manual_seed(7 + topo.rank)
        for _ in range(5):
            model(torch.randn(36, 6, generator=gen).to(topo.device)).square().mean().backward()
            algo.step()
            algo.zero_grad()
        algo.close()
        runs.append(digest(torch.cat([p.reshape(-1) for p in model.parameters()])))
    assert runs[0] == runs[1], "overlapped and post-backward reductions differ"
    assert len(set(topo.allgather_object(runs[0]))) == 1, "replicas differ"
else:  # BMUF's overlapped block sync of device packs vs the same on host tensors
    finals = {}
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Linear(40, 25).double().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        algo = build("bmuf", model, opt, topo, sync_period=2, block_overlap=True)
        g = torch.full_like(algo.grads.buffers[torch.float64], 0.01 * (topo.rank + 1))
        for _ in range(9):
            algo.grads.buffers[torch.float64].copy_(g)
            algo.step()
            algo.grads.zero_()
        algo.finish()
        finals[device] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        algo.close()
    err = float((finals["cuda"] - finals["cpu"]).abs().max())
    assert err < 1e-9, f"device and host block syncs differ by {err}"
    assert len(set(topo.allgather_object(digest(finals["cuda"])))) == 1, "nodes differ"
print(f"rank {topo.rank} OK", flush=True)
"""


DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""cuBLAS's deterministic workspace: two runs of one model give the same bits."""


@pytest.mark.parametrize("mode", ["grads", "bmuf"])
def test_training_through_the_streams_equals_the_blocking_paths(mode):
    # Two ranks as two nodes (on one GPU: staged through the host): every reduction has an
    # MPI leg, the route the comm stream and the side channel's stream are for.
    res = run_mpi(2, ["-c", TRAIN, mode], env={"HADPSGD_RANKS_PER_NODE": "1", **DETERMINISTIC})
    assert_ok(res)
    assert res.stdout.count(" OK") == 2


@four_gpus
def test_nccl_with_an_mpi_leg_overlaps_and_equals_the_blocking_path():
    # Two nodes of two GPUs: NCCL reduce-scatter, MPI between the nodes, NCCL all-gather,
    # each bucket on the comm stream during backward.
    res = run_mpi(4, ["-c", TRAIN, "grads"], env={"HADPSGD_RANKS_PER_NODE": "2",
                                                  "HADPSGD_INTRA_BACKEND": "nccl",
                                                  **DETERMINISTIC})
    assert_ok(res)
    assert "intra-node nccl" in res.stdout and res.stdout.count(" OK") == 4
