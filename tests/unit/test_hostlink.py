"""Where the cross-node leg is cut by host (issue 44 item 3): the plan and the decision.

The collectives themselves run under mpirun (tests/mpi/test_comm_layer.py, gloo standing in
for NCCL) and on two GPUs (tests/gpu/test_gpu_comm.py).
"""

from types import SimpleNamespace

import torch

from hadpsgd.comm.hostlink import device_host_link, plan_host_link


class OneRank:
    """An inter-node communicator seen from one member (allgather returns its own value)."""

    def Get_size(self) -> int:  # noqa: N802 - MPI's name
        return 1

    def Get_rank(self) -> int:  # noqa: N802 - MPI's name
        return 0


def test_plan_groups_members_by_host_in_order_of_first_appearance():
    groups, why = plan_host_link(["b", "a", "b", "a"], ["b:cuda:0:u0", "a:cuda:0:u1",
                                                        "b:cuda:1:u2", "a:cuda:1:u3"])
    assert groups == [0, 1, 0, 1] and why == ""


def test_plan_says_why_not_one_host_each_or_a_shared_gpu():
    assert plan_host_link(["a", "b"], ["a:cuda:0:u", "b:cuda:0:v"])[1].startswith("no two")
    why = plan_host_link(["a", "a", "b"], ["a:cuda:0:u", "a:cuda:0:u", "b:cuda:0:v"])[1]
    assert "share a GPU" in why and "one rank per GPU" in why


def _decide(name: str = "auto", device: str = "cuda", labels: list[str] | None = None,
            node_sizes: list[int] | None = None, nccl_inside: bool = True
            ) -> tuple[object, list[str]]:
    notes: list[str] = []
    labels = labels or ["h:cuda:0:u0", "h:cuda:1:u1"]
    link = device_host_link(name, OneRank(), SimpleNamespace(timeout=5.0), [0, 1], labels,
                            torch.device(device), node_sizes or [1, 1], nccl_inside, notes)
    return link, notes


def test_no_link_on_cpu_for_a_chosen_host_backend_or_one_super_learner():
    assert _decide(device="cpu") == (None, [])
    assert _decide(name="mpi") == (None, [])
    assert _decide(name="gloo") == (None, [])
    assert _decide(node_sizes=[2]) == (None, [])


def test_no_link_when_switched_off(monkeypatch):
    monkeypatch.setenv("HADPSGD_HOST_LINK", "0")
    assert _decide(labels=["h:cuda:0:u", "h:cuda:0:u"]) == (None, [])


def test_no_link_and_no_note_where_each_super_learner_has_a_host():
    assert _decide(labels=["a:cuda:0:u", "b:cuda:0:v"]) == (None, [])


def test_a_reason_against_the_link_is_noted_for_the_log():
    link, notes = _decide(labels=["h:cuda:0:u", "h:cuda:0:u"])
    assert link is None and "share a GPU" in notes[0] and "through MPI" in notes[0]
    link, notes = _decide(node_sizes=[2, 2], nccl_inside=False)
    assert link is None and "not on NCCL" in notes[0]
    if not torch.cuda.is_available():  # this torch cannot make NCCL: the reason says why
        link, notes = _decide()
        assert link is None and "CUDA is not available" in notes[0]
