"""Object collectives carry host tensors only (no GPU needed).

BMUF's checkpoint gathers every node's model and optimizer state onto rank 0 as pickled
objects. A pickled CUDA tensor is unpickled onto the receiver's GPU of the same index:
rank 0 would make a context on every GPU of its host and hold every node's state there.
What crosses the wire must hold no device tensor.
"""

import pickle
from collections import namedtuple

import numpy as np
import torch

from hadpsgd.comm.objects import gather_object, to_host


class DeviceTensor(torch.Tensor):
    """A host tensor that says it lives on a GPU (this machine has none)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 3)

    def cpu(self) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.as_subclass(self, torch.Tensor).clone()


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceTensor)


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


class _Request:
    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return True


class RecordingComm:
    """A two-rank communicator seen from rank 1 that records what it would send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def Get_size(self) -> int:  # noqa: N802
        return 2

    def Get_rank(self) -> int:  # noqa: N802
        return 1

    def Igather(self, send, recv, root=0):  # noqa: N802
        return _Request()

    def Igatherv(self, send, recv, root=0):  # noqa: N802
        self.sent.append(np.asarray(send).tobytes())
        return _Request()


class NoWatchdog:
    def wait(self, request, what, group=None) -> None:
        assert request.Test()


def bmuf_like_node_state() -> dict:
    # The shape of BMUF.node_state(): flat parameters, optimizer state, pending snapshots.
    return {"params": {"torch.float32": on_device(torch.arange(6.0))},
            "optimizer": {"state": {0: {"step": on_device(torch.tensor(3.0)),
                                        "exp_avg": on_device(torch.ones(6))}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "snaps": {0: [[on_device(torch.zeros(2))]]}, "wire": {}}


def test_what_is_gathered_holds_no_device_tensor():
    state = bmuf_like_node_state()
    assert all(t.device.type == "cuda" for t in tensors(state))  # the premise
    comm = RecordingComm()
    assert gather_object(comm, NoWatchdog(), (1, state), root=0) is None  # not the root
    node, received = pickle.loads(comm.sent[0])
    found = list(tensors(received))
    assert node == 1 and len(found) == 4
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in found)
    assert torch.equal(received["optimizer"]["state"][0]["exp_avg"], torch.ones(6))
    assert received["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_to_host_keeps_host_tensors_and_containers():
    t = torch.arange(3)
    pair = namedtuple("pair", "a b")(t, [t])
    out = to_host({"x": (t, [t, 1]), "p": pair, "s": "text"})
    assert out["x"][0] is t and out["x"][1][0] is t and out["x"][1][1] == 1
    assert isinstance(out["p"], tuple) and out["p"].a is t and out["s"] == "text"
