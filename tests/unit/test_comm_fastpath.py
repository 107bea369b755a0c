"""The comm layer's fast path without MPI: which scopes are one call, the guard, NCCL's wait.

Fake communicators stand in for MPI: they record the calls a reduction makes, so the direct
path (``Reducer.direct_sum_``) is checked to make exactly the call of the general path, under
the watchdog's guard, and only where that is the general path's whole work. The watchdog's
activity, as ``Topology.doing`` sets it, is checked here too.
"""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hadpsgd.comm import deadline
from hadpsgd.comm.backends import IntraBackend, MPIIntra
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.hierarchical import Reducer
from hadpsgd.comm.topology import Topology

IN_PLACE, SUM = "IN_PLACE", "SUM"


class FakeComm:
    """Records ``Allreduce`` calls (summing nothing: one rank's view)."""

    def __init__(self, size: int, rank: int = 0, name: str = "world",
                 watchdog: Any = None) -> None:
        self.size, self.rank, self.name = size, rank, name
        self.watchdog = watchdog
        self.calls: list[tuple[str, Any, int, Any]] = []
        self.fail = False

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return self.size

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Allreduce(self, send: Any, recv: np.ndarray, op: Any) -> None:  # noqa: N802
        active = self.watchdog._active if self.watchdog is not None else None
        self.calls.append((self.name, send, recv.size, active))
        if self.fail:
            raise RuntimeError("MPI error")


class RecordingWatchdog:
    """What the reducer needs of a watchdog, with the armed operations recorded."""

    timeout = 60.0

    def __init__(self) -> None:
        self._active: tuple[str, Any] | None = None
        self.armed: list[tuple[str, Any]] = []
        self.seq = 0

    def arm(self, what: str, group: list[int] | None = None) -> None:
        self.seq += 1
        self._active = (what, group)
        self.armed.append((what, group))

    def disarm(self) -> None:
        self._active = None

    def guard(self, what: str, group: list[int] | None = None) -> Any:
        wd = self

        class _G:
            def __enter__(self) -> None:
                wd.arm(what, group)

            def __exit__(self, *exc: object) -> None:
                wd.disarm()

        return _G()


class OtherIntra(IntraBackend):
    """A non-MPI host backend (as gloo): the direct path must leave it alone."""

    name = "gloo"

    def __init__(self, comm: Any, watchdog: Any, world_ranks: list[int]) -> None:
        super().__init__(comm, watchdog, world_ranks)
        self.calls = 0

    def allreduce_(self, t: torch.Tensor) -> None:
        self.calls += 1


def make(node_sizes: list[int], local_size: int | None = None, intra: str = "mpi",
         bucket_bytes: int = 1024) -> tuple[Reducer, dict[str, FakeComm], RecordingWatchdog]:
    wd = RecordingWatchdog()
    local = local_size if local_size is not None else node_sizes[0]
    comms = {"world": FakeComm(sum(node_sizes), name="world", watchdog=wd),
             "inter": FakeComm(len(node_sizes), name="inter", watchdog=wd),
             "intra": FakeComm(local, name="intra", watchdog=wd)}
    backend = (MPIIntra if intra == "mpi" else OtherIntra)(comms["intra"], wd, list(range(local)))
    red = Reducer(comms["world"], comms["inter"], backend, wd,  # type: ignore[arg-type]
                  list(range(len(node_sizes))), node_sizes, bucket_bytes)
    red._mpi = (IN_PLACE, SUM)  # no mpi4py import (MPI init) in a unit test
    return red, comms, wd


def calls(comms: dict[str, FakeComm]) -> list[tuple[str, int]]:
    return [(c[0], c[2]) for comm in comms.values() for c in comm.calls]


@pytest.mark.parametrize(
    ("node_sizes", "intra", "direct"),
    [
        ([2], "mpi", {"flat": "world", "auto": "intra", "intra": "intra", "inter": ""}),
        ([2], "gloo", {"flat": "world", "auto": None, "intra": None, "inter": ""}),
        ([1, 1, 1], "mpi", {"flat": "world", "auto": "world", "intra": "", "inter": "inter"}),
        ([2, 2], "mpi", {"flat": "world", "auto": None, "intra": "intra", "inter": None}),
        ([2, 2], "gloo", {"flat": "world", "auto": None, "intra": None, "inter": None}),
        ([1], "mpi", {"flat": "", "auto": "", "intra": "", "inter": ""}),
    ],
)
def test_direct_scopes_make_the_general_paths_one_call(node_sizes, intra, direct):
    """Where the direct path runs, it makes the very call (communicator, size, deadline
    message) the general path makes; elsewhere it declines and the tensor is untouched."""
    for scope, where in direct.items():
        red, comms, wd = make(node_sizes, intra=intra)
        t = torch.arange(10, dtype=torch.float32)
        took = red.direct_sum_(t, scope)
        assert took == (where is not None), scope
        got, armed = calls(comms), list(wd.armed)
        if where is None:
            assert got == [] and armed == []
            continue
        assert got == ([(where, 10)] if where else []), scope
        assert torch.equal(t, torch.arange(10, dtype=torch.float32))
        # The general path on a fresh reducer: the same calls under the same guard.
        red2, comms2, wd2 = make(node_sizes, intra=intra)
        if scope in ("flat", "auto"):
            red2.world_sum_(t, scope)
        else:
            (red2.intra_sum_ if scope == "intra" else red2.inter_sum_)(t)
        assert calls(comms2) == got, scope
        assert wd2.armed == armed, scope
        assert wd._active is None


def test_in_place_on_the_tensors_own_memory_with_the_named_guard():
    red, comms, wd = make([1, 1])
    t = torch.zeros(6, dtype=torch.float64)
    seen: list[Any] = []
    comms["world"].Allreduce = (  # type: ignore[method-assign]
        lambda s, r, op: seen.append((s, r, op, wd._active)))
    assert red.direct_sum_(t, "flat")
    (send, recv, op, active), = seen
    assert (send, op) == (IN_PLACE, SUM)
    assert recv.ctypes.data == t.data_ptr() and recv.size == 6
    assert active == ("allreduce of 6 torch.float64", None)
    assert wd._active is None


@pytest.mark.parametrize("case", ["too big", "strided", "float16", "bool"])
def test_what_the_direct_path_declines(case):
    red, comms, _ = make([1, 1], bucket_bytes=64)
    t = {"too big": torch.zeros(17), "strided": torch.zeros(10)[::2],
         "float16": torch.zeros(4, dtype=torch.float16),
         "bool": torch.zeros(4, dtype=torch.bool)}[case]
    assert red.direct_sum_(t, "flat") is False
    assert calls(comms) == []


def test_exactly_one_bucket_goes_direct():
    red, comms, _ = make([1, 1], bucket_bytes=64)
    assert red.direct_sum_(torch.zeros(16), "flat")
    assert calls(comms) == [("world", 16)]


def test_a_failing_call_leaves_the_guard_disarmed():
    red, comms, wd = make([1, 1])
    comms["world"].fail = True
    with pytest.raises(RuntimeError, match="MPI error"):
        red.direct_sum_(torch.zeros(3), "flat")
    assert wd._active is None


# ---------------------------------------------------------------------------- Watchdog
class FakeControl:
    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.code: int | None = None

    def Get_rank(self) -> int:  # noqa: N802
        return 1

    def Abort(self, code: int) -> None:  # noqa: N802
        self.code = code
        self.aborted.set()


@pytest.fixture
def no_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadline, "_any_source", lambda: -1)


def test_guard_marks_the_call_and_clears_it(no_mpi):
    wd = Watchdog(FakeControl(), 100.0, thread_multiple=False)
    try:
        with wd.guard("allreduce of 3 torch.float32", [0, 1]):
            what, group, until, seq = wd._active  # type: ignore[misc]
            assert (what, group, seq) == ("allreduce of 3 torch.float32", [0, 1], 1)
            assert "waiting in allreduce of 3" in wd.doing()
        assert wd._active is None
        monitor = wd._monitor
        assert monitor is not None and monitor.is_alive()
        with pytest.raises(KeyError), wd.guard("second"):
            raise KeyError("boom")
        assert wd._active is None and wd.seq == 2
        assert wd._monitor is monitor  # one monitor thread, started once
    finally:
        wd.stop()


def test_doing_tells_peers_what_this_rank_does_and_nests(no_mpi):
    wd = Watchdog(FakeControl(), 100.0, thread_multiple=False)
    need = [f.name for f in dataclasses.fields(Topology)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    topo = Topology(**{**dict.fromkeys(need), "watchdog": wd})  # doing() needs no more
    assert wd.doing() == "starting up"
    with topo.doing("writing checkpoint 3"):
        assert wd.doing() == "writing checkpoint 3"
        with topo.doing("evaluating held-out"):
            assert wd.doing() == "evaluating held-out"
        assert wd.doing() == "writing checkpoint 3"
        with pytest.raises(KeyError), topo.doing("loading a batch"):
            raise KeyError("boom")
        assert wd.doing() == "writing checkpoint 3"  # restored on an error too
    assert wd.doing() == "starting up"
    topo.now_doing("in training step 7")
    assert wd.doing() == "in training step 7"
    with topo.doing("evaluating held-out"):
        pass
    assert wd.doing() == "in training step 7"


def test_guarded_call_past_the_deadline_is_named_and_aborts(no_mpi, capfd):
    control = FakeControl()
    wd = Watchdog(control, 0.05, thread_multiple=False)
    try:
        with wd.guard("allreduce of 10 torch.float32"):
            assert control.aborted.wait(15.0), "the monitor never aborted the stuck call"
    finally:
        wd.stop()
    assert control.code == 3
    err = capfd.readouterr().err
    assert "rank 1: allreduce of 10 torch.float32 did not complete within 0.05 s" in err
    assert "(HADPSGD_TIMEOUT)" in err  # the variable the deadline came from


def test_the_first_contact_waits_under_the_start_up_deadline(no_mpi, monkeypatch):
    """MPICH's MPI_Init returns without waiting for every rank: a rank still importing is
    met at the first contact, which is MPI's start-up too (HADPSGD_START_TIMEOUT); the
    watchdog made after it keeps the run's deadline."""
    import importlib

    comm_init = importlib.import_module("hadpsgd.comm.init")  # the module, not comm.init
    waited: list[tuple[float, str]] = []
    monkeypatch.setattr(Watchdog, "wait",
                        lambda self, request, what: waited.append((self.timeout, self.setting)))
    world = FakeControl()
    world.Idup = lambda: (FakeControl(), object())  # type: ignore[attr-defined]
    watchdog = comm_init._first_contact(world, 4.0, False, (60.0, "HADPSGD_START_TIMEOUT"))
    assert waited == [(60.0, "HADPSGD_START_TIMEOUT")]
    assert (watchdog.timeout, watchdog.setting) == (4.0, "HADPSGD_TIMEOUT")


def test_the_deadline_s_variable_is_named_where_another_set_it(no_mpi, capfd):
    # The start-up's first contact takes HADPSGD_START_TIMEOUT where set (comm/init.py)
    control = FakeControl()
    wd = Watchdog(control, 0.05, thread_multiple=False, setting="HADPSGD_START_TIMEOUT")
    try:
        with wd.guard("first contact (control communicator, Idup)"):
            assert control.aborted.wait(15.0), "the monitor never aborted the stuck call"
    finally:
        wd.stop()
    err = capfd.readouterr().err
    assert "did not complete within 0.05 s (HADPSGD_START_TIMEOUT)" in err, err


def test_a_peer_answering_from_inside_the_same_call_is_not_named_missing(no_mpi, monkeypatch):
    """Rank 2 entered the same call later (its own deadline not yet passed, so it sent no
    note): it answers from inside it and is no culprit; rank 0, elsewhere, is."""
    from hadpsgd.comm.deadline import CommTimeoutError

    class ThreeRanks(FakeControl):
        def Get_size(self) -> int:  # noqa: N802
            return 3

    wd = Watchdog(ThreeRanks(), 4.0, thread_multiple=False)
    wd.seq = 9
    replies = {0: "alive, starting up",
               2: "alive, waiting in intra-node allreduce (mpi) (operation #9)"}
    monkeypatch.setattr(wd, "_diagnose", lambda peers: ([0, 2], replies))
    with pytest.raises(CommTimeoutError) as info:
        wd.fail("intra-node allreduce (mpi)")
    assert info.value.missing == [0] and "rank(s) 0 never arrived" in str(info.value)
    replies[2] = "alive, waiting in intra-node allreduce (mpi) (operation #8)"  # another call
    with pytest.raises(CommTimeoutError) as info:
        wd.fail("intra-node allreduce (mpi)")
    assert info.value.missing == [0, 2]


# ---------------------------------------------------------------------------- NCCL wait
def test_nccl_wait_blocks_on_a_blocking_event_under_the_guard(monkeypatch):
    from hadpsgd.comm import nccl

    wd = RecordingWatchdog()
    log: list[Any] = []

    class Event:
        def __init__(self, blocking: bool = False) -> None:
            log.append(("event", blocking))

        def record(self, stream: Any) -> None:
            log.append(("record", stream))

        def synchronize(self) -> None:
            log.append(("synchronize", wd._active))
            if fail:
                raise RuntimeError("CUDA error")

        def query(self) -> bool:
            raise AssertionError("the wait must not poll")

    class Work:
        def wait(self) -> None:
            log.append(("work.wait",))

    class PG:
        def abort(self) -> None:
            log.append(("abort",))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    backend = object.__new__(nccl.NCCLIntra)
    backend.watchdog, backend.world_ranks = wd, [0, 1]  # type: ignore[assignment]
    backend.device, backend.pg = torch.device("cuda", 0), PG()  # type: ignore[assignment]

    fail = False
    backend._wait(Work(), "allreduce")
    assert log == [("work.wait",), ("event", True), ("record", "stream"),
                   ("synchronize", ("intra-node allreduce (nccl)", [0, 1]))]
    assert wd._active is None

    log.clear()
    fail = True
    with pytest.raises(RuntimeError, match="CUDA error"):
        backend._wait(Work(), "broadcast")
    assert log[-1] == ("abort",) and wd._active is None


def test_a_wait_during_which_this_rank_was_stopped_knows_it():
    """The monotonic clock runs on while a process is stopped: a timed-out wait records the
    longest gap between its checks, so a rank frozen past its deadline (then let go by the
    launcher) says it was itself the late one instead of "every peer is waiting too"."""
    import time

    from hadpsgd.comm.deadline import poll, stalled_for

    assert not poll(lambda: False, 0.05)
    assert stalled_for() < 0.04  # checked every millisecond or so
    assert not poll(lambda: time.sleep(0.3) or False, 0.2)  # one check took 0.3 s
    assert stalled_for() >= 0.29


class DeferringGroup:
    """An NCCL group's deferral calls, logged (what NCCLIntra's join and settle do)."""

    def __init__(self, size: int, log: list[str], name: str) -> None:
        self.size, self.log, self.name = size, log, name

    def allreduce_deferred_(self, t: torch.Tensor, avg: bool = True) -> None:
        self.log.append(f"{self.name} deferred")

    def join(self, host_wait: bool = True) -> None:
        self.log.append(f"{self.name} join host_wait={host_wait}")

    def settle(self) -> bool:
        self.log.append(f"{self.name} settle")
        return self.name == "host link"


def test_the_world_mean_of_super_learners_of_one_on_one_host_defers_on_the_host_link():
    # Issue 59 item 7: with super-learners of one GPU all on one host the world's mean is
    # the host link's one NCCL allreduce, so it defers as the node's does (backward runs on
    # while NCCL reduces); across hosts (an MPI leg) or with several learners a node it
    # does not, and the node's own deferral is unchanged.
    log: list[str] = []
    red, _, _ = make([1, 1, 1, 1])
    assert not red.deferrable("world")  # no host link
    red.host_link = SimpleNamespace(hosts=1, local=DeferringGroup(4, log, "host link"))
    assert red.deferrable("world") and not red.deferrable("intra")
    assert red._deferring("world") is red.host_link.local
    red.join_deferred(host_wait=False)
    assert red.settle_deferred() is True
    assert log == ["host link join host_wait=False", "host link settle"]
    red.host_link = SimpleNamespace(hosts=2, local=DeferringGroup(2, log, "host link"))
    assert not red.deferrable("world")  # two hosts: the leaders' MPI leg must wait
    red.host_link = SimpleNamespace(hosts=1, local=None)
    assert not red.deferrable("world")
    node, _, _ = make([2, 2])
    node.device_intra = DeferringGroup(2, log, "node")
    node.host_link = SimpleNamespace(hosts=1, local=DeferringGroup(2, log, "host link"))
    assert node.deferrable("intra") and not node.deferrable("world")
    assert node._deferring("intra") is node.device_intra
    one, _, _ = make([4])
    one.device_intra = DeferringGroup(4, log, "node")
    assert one.deferrable("world")  # one node: its allreduce is the world's
