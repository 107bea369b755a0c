"""The CUDA ordering of the comm layer's copies and reductions, checked on the CPU.

A fake ``torch.cuda`` (streams, events, the current stream per thread) records which stream
waits for which event and where events are recorded, so the order each CUDA branch sets up
is checked without a GPU: the gradient buckets' comm stream (``comm.streams.ReadyEvents``
in ``BucketReducer``), the copy stream of gossip's snapshot and delta (``comm.copies``),
the side channel's jobs, the single-chunk staging path and its chunk plan. The copies
themselves run on host tensors (a non-blocking copy of host tensors is a plain copy). The
same code on a GPU is checked in ``tests/gpu/test_gpu_streams.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hadpsgd.comm.copies import CopyStream
from hadpsgd.comm.overlap import BucketPlan, BucketReducer
from hadpsgd.comm.pair import _from_host, _to_host
from hadpsgd.comm.side import Job
from hadpsgd.comm.staging import Stager, chunk_plan
from hadpsgd.comm.streams import ReadyEvents

CUDA0 = torch.device("cuda", 0)


class FakeCuda:
    """Streams and events that log what they are asked to do (shared by every thread)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.ids = itertools.count(1)
        self.local = threading.local()
        self.compute = self.Stream(name="compute")

    def current(self) -> Any:
        return getattr(self.local, "stream", self.compute)

    # torch.cuda's names -------------------------------------------------------------
    def Stream(self, device: Any = None, priority: int = 0, name: str = "") -> Any:  # noqa: N802
        fake = self

        class _Stream:
            def __init__(self) -> None:
                self.cuda_stream = next(fake.ids)
                self.name = name or f"stream{self.cuda_stream}"
                self.device = CUDA0
                self.priority = priority

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait", self.name, event.name))

            def wait_stream(self, other: Any) -> None:
                fake.log.append(("wait_stream", self.name, other.name))

        return _Stream()

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> Any:  # noqa: N802
        fake = self

        class _Event:
            def __init__(self) -> None:
                self.name = f"event{next(fake.ids)}"
                self.blocking = blocking

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", self.name, (stream or fake.current()).name))

            def synchronize(self) -> None:
                fake.log.append(("sync", self.name, "blocking" if self.blocking else "spin"))

        return _Event()

    def current_stream(self, device: Any = None) -> Any:
        return self.current()

    def set_device(self, device: Any) -> None:
        self.log.append(("set_device", str(device)))

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        before = self.current()
        self.local.stream = stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.local.stream = before


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    f = FakeCuda()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("Stream", "Event", "current_stream", "stream", "set_device"):
            mp.setattr(torch.cuda, name, getattr(f, name))
        yield f


def names(log: list[tuple[str, ...]], kind: str) -> list[tuple[str, ...]]:
    return [entry[1:] for entry in log if entry[0] == kind]


# --------------------------------------------------------------------------- staging
@pytest.mark.parametrize(("numel", "step", "want"), [
    (0, 4, [(0, 0)]), (1, 4, [(0, 1)]), (4, 4, [(0, 4)]), (5, 4, [(0, 4), (4, 5)]),
    (12, 4, [(0, 4), (4, 8), (8, 12)])])
def test_chunk_plan(numel: int, step: int, want: list[tuple[int, int]]) -> None:
    assert chunk_plan(numel, step) == want


def test_chunk_plan_refuses_a_zero_step() -> None:
    with pytest.raises(ValueError, match="chunk step"):
        chunk_plan(8, 0)


def test_a_message_of_one_chunk_is_one_copy_each_way_and_one_wait(fake: FakeCuda) -> None:
    stager = Stager(pin=False)
    t = torch.arange(6, dtype=torch.bfloat16)
    seen = []

    def op(host: torch.Tensor) -> None:
        seen.append(host.dtype)
        host.add_(1.0)

    stager.run_whole(t, op)
    assert seen == [torch.float32]  # MPI reduces half precision in fp32
    assert torch.equal(t, torch.arange(6, dtype=torch.bfloat16) + 1)
    # One event, recorded on the caller's stream and slept on; no side stream involved.
    assert names(fake.log, "record") == [(names(fake.log, "sync")[0][0], "compute")]
    assert names(fake.log, "sync")[0][1] == "blocking"
    assert not names(fake.log, "wait_stream") and not names(fake.log, "enter")
    assert not stager._streams
    # Another stream gets a host buffer (and an event) of its own.
    side = fake.Stream(name="side")
    with fake.stream(side):
        stager.run_whole(t, op)
    assert names(fake.log, "record")[-1][1] == "side"
    assert len([k for k in stager._buffers if k[1][0] == "whole"]) == 2


# --------------------------------------------------------------------------- buckets
def test_ready_events_one_record_per_bucket_on_one_stream(fake: FakeCuda) -> None:
    ev = ReadyEvents(CUDA0, 2)
    ev.mark(0, complete=False)
    ev.mark(0, complete=False)
    assert not names(fake.log, "record")  # nothing until the bucket is complete
    ev.mark(0, complete=True)
    (event, stream), = names(fake.log, "record")
    assert stream == "compute"
    ev.wait(0)
    assert names(fake.log, "wait") == [(ev.stream.name, event)]
    ev.wait(0)  # waited for once per step
    assert len(names(fake.log, "wait")) == 1


def test_ready_events_cover_every_stream_a_bucket_was_made_on(fake: FakeCuda) -> None:
    ev = ReadyEvents(CUDA0, 1)
    other = fake.Stream(name="other")
    ev.mark(0, complete=False)  # compute
    with fake.stream(other):
        ev.mark(0, complete=False)  # the compute stream's part is queued: record it now
        ev.mark(0, complete=True)
    assert [s for _, s in names(fake.log, "record")] == ["compute", "other"]
    ev.wait(0)
    assert len(names(fake.log, "wait")) == 2
    ev.join()
    assert names(fake.log, "wait_stream") == [("compute", ev.stream.name)]


def test_background_buckets_are_reduced_on_the_comm_stream(fake: FakeCuda) -> None:
    # The reducer's logic with the events a GPU buffer would get: each bucket's reduction
    # runs on the comm stream after it waited for that bucket's event, and finish() makes
    # the compute stream wait for the comm stream once.
    plan = BucketPlan([(torch.float32, 4 * i, 4) for i in range(3)], 16)
    buf = torch.ones(12)
    streams: list[str] = []

    def reduce(view: torch.Tensor, scope: str) -> None:
        streams.append(torch.cuda.current_stream().name)
        view.mul_(2)

    red = BucketReducer(plan, {torch.float32: buf}, reduce, lambda: "world", lambda v: v.sum(),
                        background=True, timeout=30.0)
    red._events = ReadyEvents(CUDA0, len(plan))  # what a CUDA buffer gets
    comm = red._events.stream.name
    try:
        for step in range(2):
            fake.log.clear()
            red.param_ready(2)  # bucket 0: the last parameter comes first
            red.param_ready(1)
            sums = red.finish()  # parameter 0's hook never fired
            assert streams[-3:] == [comm] * 3 and len(sums) == 3
            records = names(fake.log, "record")
            assert [s for _, s in records] == ["compute"] * 3
            waits = names(fake.log, "wait")
            assert sorted(e for _, e in waits) == sorted(e for e, _ in records)
            assert {s for s, _ in waits} == {comm}
            assert names(fake.log, "wait_stream") == [("compute", comm)]
            assert torch.equal(buf, torch.full((12,), 2.0 ** (step + 1)))
    finally:
        red.close()


# --------------------------------------------------------------------------- copies
def test_copy_stream_orders_snapshots_and_writes_by_events(fake: FakeCuda) -> None:
    copies = CopyStream(CUDA0)
    (init, where), = names(fake.log, "record")
    assert where == "compute"  # the tensor as it is at construction
    src, out = torch.arange(4.0), torch.zeros(4)
    copies.fetch(src, out)
    assert names(fake.log, "wait")[-1] == (copies.stream.name, init)
    assert names(fake.log, "record")[-1][1] == copies.stream.name  # the read's end
    read = names(fake.log, "record")[-1][0]
    copies.wait()
    assert names(fake.log, "sync")[-1] == (read, "blocking")
    assert torch.equal(out, src)
    with copies.writing():
        # The compute stream waits for the read, on the device: the host did not wait here.
        assert names(fake.log, "wait")[-1] == ("compute", read)
        src.add_(1)
    written = names(fake.log, "record")[-1]
    assert written == (init, "compute")  # the next fetch waits for this write
    copies.fetch(src, out)
    assert names(fake.log, "wait")[-1] == (copies.stream.name, init)
    dst = torch.zeros(4)
    copies.upload(out, dst)
    put = names(fake.log, "record")[-1]
    assert put[1] == copies.stream.name
    copies.arrived()
    assert names(fake.log, "wait")[-1] == ("compute", put[0])
    assert torch.equal(dst, torch.arange(4.0) + 1)


def test_copy_stream_on_the_cpu_is_plain_copies(fake: FakeCuda) -> None:
    copies = CopyStream("cpu")
    src, out, dst = torch.arange(3.0), torch.zeros(3), torch.zeros(3)
    with copies.writing():
        src.add_(1)
    copies.fetch(src, out)
    copies.wait()
    assert copies.upload(out, dst) is dst
    copies.arrived()
    assert not copies.host(3, torch.float32).is_pinned()
    assert torch.equal(dst, torch.arange(3.0) + 1)
    assert fake.log == []  # no stream or event was touched


# --------------------------------------------------------------------------- side jobs
def test_a_side_job_runs_on_its_stream_behind_the_submitters_event(fake: FakeCuda) -> None:
    side = fake.Stream(name="side")
    ran: list[str] = []
    job = Job(lambda: ran.append(torch.cuda.current_stream().name), "mean", side)
    (ready, where), = names(fake.log, "record")
    assert where == "compute"
    done = threading.Thread(target=job.run)
    done.start()
    done.join()
    assert ran == ["side"] and job.error is None
    assert names(fake.log, "set_device") == [(str(CUDA0),)]  # the thread is bound first
    assert names(fake.log, "wait") == [("side", ready)]
    finished = names(fake.log, "record")[-1]
    assert finished[1] == "side"
    job.arrived()
    assert names(fake.log, "wait")[-1] == ("compute", finished[0])


def test_a_host_job_touches_no_stream(fake: FakeCuda) -> None:
    job = Job(lambda: None, "mean")
    job.run()
    job.arrived()
    assert job.done.is_set() and fake.log == []


# --------------------------------------------------------------------------- pair channel
def test_a_staged_pair_exchange_waits_once_per_copy_off_the_device(fake: FakeCuda) -> None:
    send, host = torch.arange(5.0), torch.zeros(5)
    _to_host(send, host)
    assert torch.equal(host, send)
    (event, where), = names(fake.log, "record")
    assert where == "compute" and names(fake.log, "sync") == [(event, "blocking")]
    recv = torch.zeros(5)
    landed = _from_host(host, recv)  # queued on the caller's stream, not waited for
    assert torch.equal(recv, send) and len(names(fake.log, "sync")) == 1
    assert names(fake.log, "record")[-1] == (landed.name, "compute") and landed.blocking


def test_every_thread_that_touches_cuda_binds_its_device_first(monkeypatch):
    """Issue 44: the gossip thread, the side channel's jobs and the bucket reducer's thread bind
    their GPU (:func:`bind_thread`) before any CUDA call, so that leaving a stream's context
    does not switch them to GPU 0 (a context there per rank); a host device binds nothing."""
    import inspect

    from hadpsgd.algorithms.gossip import GossipThread
    from hadpsgd.comm import streams
    from hadpsgd.comm.overlap import BucketReducer

    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    streams.bind_thread(torch.device("cpu"))
    streams.bind_thread(None)
    assert calls == []
    streams.bind_thread(torch.device("cuda", 3))
    assert calls == [torch.device("cuda", 3)]
    # The side channel's job is checked by what it does (the side job test above); these two
    # threads' bodies run in loops of their own: bound before anything else they do.
    for entry, body in ((GossipThread.run, "self._loop()"), (BucketReducer._serve, "while")):
        src = inspect.getsource(entry)
        assert 0 < src.find("bind_thread(") < src.find(body), entry.__qualname__
