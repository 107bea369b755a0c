"""The torch.distributed intra-node groups: the rendezvous and NCCL's start-up, on CPU.

``TorchIntra`` (gloo here; NCCL is the same class on GPUs) meets through a FileStore (one
host) or a TCP store (a node across hosts); either must wait ``HADPSGD_TIMEOUT`` for a peer,
not torch's default of 5 minutes. A group of one (no MPI: its object collectives return at
once) builds the real stores in this process. ``NCCLIntra`` makes its communicator at
start-up, under the deadline: its steps are checked here on a fake process group
(``tests/gpu/test_gpu_comm.py`` checks the real one).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from hadpsgd.comm.backends import STORE_TIMEOUT_CAP_S, GlooIntra, store_timeout
from hadpsgd.comm.deadline import CommTimeoutError
from hadpsgd.comm.nccl import NCCLIntra

dist = pytest.importorskip("torch.distributed")


class OneRank:
    """The node communicator of a node of one (all the group's MPI calls need)."""

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return 1

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return 0


def _group(deadline_s: float) -> GlooIntra:
    return GlooIntra(OneRank(), SimpleNamespace(timeout=deadline_s), [0])  # type: ignore[arg-type]


def test_store_timeout_is_the_deadline_capped():
    assert store_timeout(37.0) == datetime.timedelta(seconds=37)
    # HADPSGD_TIMEOUT=inf (no deadline) is allowed; a timedelta cannot hold it.
    assert store_timeout(float("inf")) == datetime.timedelta(seconds=STORE_TIMEOUT_CAP_S)


def test_file_store_waits_the_deadline():
    group = _group(2.5)
    try:
        assert group.rendezvous == "file"
        assert group.store.timeout == datetime.timedelta(seconds=2.5)
        # A key no peer ever sets: the store gives up at the deadline, not after 5 minutes.
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="imeout"):
            group.store.get("never-set")
        assert time.monotonic() - start < 30
    finally:
        group.close()


def test_tcp_store_waits_the_deadline():
    group = _group(3.0)
    try:
        store = group._tcp_store("127.0.0.1", ["127.0.0.1"], store_timeout(3.0))
        assert store.timeout == datetime.timedelta(seconds=3)
    finally:
        group.close()


class Deadline:
    """A watchdog that records whether a call ran under its guard."""

    timeout = 5.0

    def __init__(self) -> None:
        self.armed: str | None = None
        self.failed: list[str] = []

    @contextlib.contextmanager
    def guard(self, what: str, group: list[int] | None = None) -> Iterator[None]:
        self.armed = what
        try:
            yield
        finally:
            self.armed = None

    def fail(self, what: str, group: list[int] | None = None) -> None:
        self.failed.append(what)
        raise CommTimeoutError(f"{what}: rank(s) 5 never arrived", missing=[5])


class Group:
    """A process group of two that logs each call and whether it ran guarded."""

    def __init__(self, watchdog: Deadline, error: Exception | None = None) -> None:
        self.watchdog, self.error, self.calls = watchdog, error, []

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.calls.append(("connect", str(device), self.watchdog.armed is not None))
        if self.error is not None:
            raise self.error

    def allreduce(self, tensors: list[torch.Tensor]) -> SimpleNamespace:
        self.calls.append(("allreduce", tensors[0].numel(), self.watchdog.armed is not None))
        tensors[0].mul_(2)  # the sum over two learners of ones
        return SimpleNamespace(wait=lambda: self.calls.append(
            ("wait", None, self.watchdog.armed is not None)))


def _nccl(group_error: Exception | None = None) -> tuple[NCCLIntra, Group]:
    backend = object.__new__(NCCLIntra)  # the start-up alone: no GPU, no store
    backend.watchdog = Deadline()
    backend.pg = Group(backend.watchdog, group_error)
    backend.device, backend.world_ranks, backend.rank, backend.size = (
        torch.device("cpu"), [4, 5], 0, 2)
    backend._host_wait = lambda what: backend.pg.calls.append(("host wait", what, False))
    return backend, backend.pg


def test_nccl_communicator_is_made_bound_and_guarded_before_any_collective():
    backend, group = _nccl()
    assert backend._connect() >= 0
    assert group.calls == [("connect", "cpu", True), ("allreduce", 1, True),
                           ("wait", None, True), ("host wait", "start-up allreduce", False)]


def test_nccl_store_timeout_names_the_missing_peer():
    backend, _ = _nccl(RuntimeError("Timeout waiting for key: default_pg/0//cuda//0 after "
                                    "5000 ms"))
    with pytest.raises(CommTimeoutError, match="never arrived"):
        backend._connect()
    assert backend.watchdog.failed == ["intra-node NCCL communicator set-up on cpu (nccl)"]


def test_nccl_failure_to_connect_names_the_nodes_ranks():
    backend, _ = _nccl(RuntimeError("NCCL error: unhandled system error"))
    with pytest.raises(RuntimeError, match=r"rank 4: the NCCL communicator of the node's "
                                           r"ranks \[4, 5\] could not be made"):
        backend._connect()
    assert not backend.watchdog.failed


def test_the_tcp_store_listens_on_the_interface_facing_the_peers_only():
    """The store has no authentication: it listens on the address that routes to the node's
    other hosts, not on every interface; a peer that cannot be resolved falls back to torch's
    own listening (None here)."""
    from hadpsgd.comm.backends import facing_address, listening_socket

    assert facing_address("127.0.0.1")[1] == "127.0.0.1"
    sock = listening_socket(["127.0.0.1"])
    try:
        assert sock is not None and sock.getsockname()[0] == "127.0.0.1"
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()
    assert listening_socket(["no-such-host.invalid"]) is None
    assert listening_socket([]) is None


def test_a_join_can_leave_its_host_wait_to_settle():
    # Issue 44 item 8(c): the gradient means' join makes the stream wait only; the host
    # waits once, in settle(), after the step's finiteness and norm are queued behind them.
    backend, group = _nccl()
    backend._deferred, backend._owed = [SimpleNamespace(wait=lambda: group.calls.append(
        ("wait", None, False)))], None
    backend.join(host_wait=False)
    assert group.calls == [("wait", None, False)] and backend._deferred == []
    assert backend.settle() is True
    assert backend.settle() is False  # nothing owed any more
    assert group.calls == [("wait", None, False), ("host wait", "gradient allreduce", False)]
    backend._deferred = [SimpleNamespace(wait=lambda: None)]
    backend.join()  # the default: the host waits at once, nothing left owed
    backend.settle()
    assert group.calls[2:] == [("host wait", "gradient allreduce", False)]
