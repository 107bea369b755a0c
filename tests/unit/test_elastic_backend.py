"""Which collectives ``--on-failure continue`` refuses at start (``check_backend``): the
ones a dead learner leaves its peers stuck in, which ULFM cannot interrupt. Decided from the
topology's agreed backends alone, so it is tested here without MPI or a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hadpsgd.assembly.elastic import check_backend
from hadpsgd.cli import ConfigError


def topo(intra: str, node_sizes: list[int], link: str | None = None,
         hosts: int = 1) -> SimpleNamespace:
    """A topology's agreed facts: its intra-node backend, node sizes and host link."""
    host_link = SimpleNamespace(name=link, kind="cuda", hosts=hosts) if link else None
    return SimpleNamespace(intra_backend=intra, node_sizes=node_sizes,
                           reducer=SimpleNamespace(host_link=host_link))


@pytest.mark.parametrize(("intra", "sizes"), [("mpi", [2, 2]), ("nccl", [1, 1, 1]),
                                              ("gloo", [1, 1]), ("mpi", [1, 1])])
def test_what_mpi_carries_or_no_node_mate_shares_goes_on(intra: str, sizes: list[int]) -> None:
    check_backend(topo(intra, sizes))  # no refusal


@pytest.mark.parametrize(("intra", "stuck"), [("nccl", "NCCL kernel"), ("gloo", "HADPSGD_TIMEOUT")])
def test_nccl_or_gloo_inside_a_node_is_refused(intra: str, stuck: str) -> None:
    with pytest.raises(ConfigError, match=f"{intra} inside a node.*{stuck}.*--intra-backend mpi"):
        check_backend(topo(intra, [2, 2]))


@pytest.mark.parametrize("hosts", [1, 2])
def test_nccl_between_super_learners_of_one_host_is_refused(hosts: int) -> None:
    """Flat ADPSGD or BMUF with one learner a node on a GPU host: the host link (NCCL) puts
    the block average, the gossip swap and the side twin on NCCL (issue 59, item 1)."""
    with pytest.raises(ConfigError, match="nccl between the super-learners of one host.*"
                                          "HADPSGD_HOST_LINK=0.*drop --on-failure continue"):
        check_backend(topo("nccl", [1, 1, 1, 1], link="nccl", hosts=hosts))
