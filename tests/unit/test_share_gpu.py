"""The shared-GPU test mode's decisions (``HADPSGD_SHARE_GPU``, issue 59), without a GPU.

On one GPU, each rank is made a GPU of its own (its device label carries its rank) on K
pretend hosts of consecutive ranks, and NCCL is given a host id per rank and sockets on
loopback; the mode is refused on CPU and across machines. Checked here as functions; the
NCCL runs themselves are part of ``scripts/gpu_check.sh --part share`` (a GPU only).
"""

from __future__ import annotations

import pytest

from hadpsgd.comm import share_gpu
from hadpsgd.comm.hostlink import plan_host_link
from hadpsgd.comm.placement import summarize

ONE_GPU = "vm:cuda:0:GPU-1234"  # what every rank's device_label says on one GPU


def test_each_rank_is_a_gpu_of_its_own_on_consecutive_pretend_hosts() -> None:
    labels = [share_gpu.label(ONE_GPU, r, 4, 2) for r in range(4)]
    assert labels == ["vm~0:cuda:0:GPU-1234:r0", "vm~0:cuda:0:GPU-1234:r1",
                      "vm~1:cuda:0:GPU-1234:r2", "vm~1:cuda:0:GPU-1234:r3"]
    assert len(set(labels)) == 4  # hadpsgd's duplicate-GPU checks see four GPUs
    assert summarize(labels) == "vm~0 [0>cuda:0 1>cuda:0]; vm~1 [2>cuda:0 3>cuda:0]"


def test_the_host_link_plans_on_pretend_hosts_as_on_real_ones() -> None:
    # 4 super-learners of one rank on 2 pretend hosts: two host groups, no shared GPU
    labels = [share_gpu.label(ONE_GPU, r, 4, 2) for r in range(4)]
    hosts = [lab.partition(":")[0] for lab in labels]
    assert plan_host_link(hosts, labels) == ([0, 0, 1, 1], "")
    # without the mode the same ranks share a GPU, and the host link says why it cannot run
    _, why = plan_host_link(["vm"] * 4, [ONE_GPU] * 4)
    assert "share a GPU" in why


@pytest.mark.parametrize(("device", "host_size", "size", "hosts", "says"), [
    ("cpu", 2, 2, 1, "this run is on cpu"),
    ("cuda", 2, 4, 2, "span several"),
    ("cuda", 2, 2, 3, "more pretend hosts than the 2 ranks"),
])
def test_refused_where_it_cannot_mean_anything(device: str, host_size: int, size: int,
                                               hosts: int, says: str) -> None:
    why = share_gpu.problem(device, host_size, size, hosts)
    assert why is not None and says in why and "HADPSGD_SHARE_GPU" in why


def test_allowed_on_one_machine_with_a_gpu() -> None:
    assert share_gpu.problem("cuda", 4, 4, 2) is None


def test_nccl_gets_a_host_id_per_rank_and_sockets_unless_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("NCCL_HOSTID", *share_gpu.NCCL_SOCKETS):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")  # the user's: kept
    share_gpu.set_nccl_environment(3)
    import os

    assert os.environ["NCCL_HOSTID"] == "hadpsgd-share-rank3"
    assert os.environ["NCCL_NET"] == "Socket" and os.environ["NCCL_IB_DISABLE"] == "1"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "eth0"
    # a host id the user set for every rank is made per rank (shared, NCCL sees duplicates)
    monkeypatch.setenv("NCCL_HOSTID", "mine")
    share_gpu.set_nccl_environment(1)
    assert os.environ["NCCL_HOSTID"] == "mine-rank1"


def test_the_start_says_test_mode_and_what_it_cannot_show() -> None:
    text = share_gpu.note(4, 2)
    assert "TEST MODE" in text and "4 GPUs on 2 pretend host" in text and "timings" in text
