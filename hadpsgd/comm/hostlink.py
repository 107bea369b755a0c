"""Exchanges between super-learners that share a host: NCCL there, MPI between hosts.

The cross-node leg of every reduction (BMUF's block average, the hierarchical world mean's
middle step, the super-learners' buffers) runs over the inter-node communicator: the
learners of one local rank, one per super-learner. Where several super-learners sit on one
host (an 8-GPU host with super-learners of 1, 2 or 4 GPUs), that leg would otherwise go
through pinned host copies and MPI's shared memory although the GPUs share NVLink.
:class:`HostLink` cuts the leg by host instead:

- the members of the inter-node communicator on this host sum over a torch.distributed
  group of their own (NCCL on GPUs; any :class:`~hadpsgd.comm.backends.TorchIntra`, gloo in
  the CPU tests);
- where the communicator spans several hosts with as many members on each (the usual
  8-GPU hosts), in the shard form: the host group reduce-scatters, each member sums its
  shard over MPI with the members of the same place on the other hosts (every rank's NIC
  carries a share, as the hierarchical reducer's shard form does), and the host group
  allgathers the sums (issue 59 item 7);
- where the hosts hold different numbers of members, the first member on each host (its
  host leader) carries the host's sum to the other hosts' leaders over MPI, then shares
  the result on its host (reduce, MPI allreduce, broadcast);
- where it lies on one host, that is one allreduce.

Every member ends with the same bits: across hosts a sum is made once, then copied; on one
host NCCL's allreduce gives them (its ring and tree reduce each element once). The plan
(:func:`plan_host_link`) is pure, so which ranks meet where is tested without a GPU.

*One thread launches NCCL* (issue 59 item 5). NCCL's kernels on different communicators of
one GPU may deadlock unless every rank launches them in the same order; a background thread
launching on its own communicator beside the main thread's would interleave differently on
different ranks (in H-ADPSGD the gradient buckets, the host link and the gossip's swap were
three communicators from three threads). So only the main thread launches NCCL, with the
threads it waits on while they do: autograd's during backward, and the gradient reducer's
(``hadpsgd-grad-reduce``: the buckets' means, the host link's deferred mean, the pipeline),
whose launches :meth:`~hadpsgd.comm.overlap.BucketReducer.finish` waits for before the main
thread goes on (no NCCL launch of the main thread may come before that wait): in program
order, the same on every rank. The exchanges of background threads take MPI, which
MPI_THREAD_MULTIPLE makes safe from any thread: ADPSGD's gossip swap (also between leaders
on one host: CUDA-aware MPI, or staged through pinned host buffers) and BMUF's overlapped
block average; a side channel whose means run on the caller's thread keeps a :meth:`twin`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hadpsgd.comm.backends import IntraBackend
from hadpsgd.comm.deadline import Watchdog

Factory = Callable[[Any, Watchdog, list[int]], IntraBackend]
"""Makes the host group's backend from its communicator, the watchdog of its waits and its
members' world ranks."""

MpiSum = Callable[[Any, torch.Tensor, str, "list[int] | None"], None]
"""An in-place MPI sum of a tensor over a communicator (the reducer's, which stages)."""


def _number(hosts: list[Any]) -> tuple[list[int], int]:
    """Each member's host index (hosts numbered in order of first appearance), and how many."""
    order: dict[Any, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts], len(order)


def plan_host_link(hosts: list[str], devices: list[str]) -> tuple[list[int], str]:
    """Which host group each member of an inter-node communicator joins, and any obstacle.

    Args:
        hosts: Each member's host name, by rank in the communicator.
        devices: Each member's device label (:func:`~hadpsgd.comm.placement.device_label`).

    Returns:
        The host index of each member (hosts numbered in order of first appearance) and
        why a host group cannot work (``""`` if it can): two members of one host on one
        GPU (NCCL needs a GPU per rank), or no host holding two members (nothing to gain:
        the leg stays MPI's).
    """
    groups, count = _number(hosts)
    if count == len(hosts):
        return groups, "no two super-learners share a host"
    for host in dict.fromkeys(hosts):
        gpus = [d for h, d in zip(hosts, devices, strict=True) if h == host]
        if len(set(gpus)) < len(gpus):
            return groups, (f"super-learners on {host} share a GPU; NCCL needs one GPU per "
                            "rank: launch at most one rank per GPU")
    return groups, ""


Buffer = Callable[[int, int], torch.Tensor]
"""A buffer of ``numel`` elements of the summed tensor's dtype and device, by slot: 0 for the
padded whole, 1 for this member's shard (:func:`shard_sum_`)."""


def shard_sum_(group: IntraBackend, t: torch.Tensor, across: Callable[[torch.Tensor], None],
               buffer: Buffer | None = None) -> None:
    """Sum ``t`` in the shard form: reduce-scatter, each shard summed across, allgather.

    ``group`` reduce-scatters, ``across`` sums this member's shard with the same shard of the
    other groups, and ``group`` allgathers the shards. ``t`` is padded with zeros to a
    multiple of the group's size (a copy only where it is not one already); each element is
    summed once in the group and once across, then copied, so every member ends with the
    same bits. The hierarchical reducer's buckets and the host link between hosts both sum
    this way.

    Args:
        group: The group of this member (a node, or the super-learners of a host).
        t: A contiguous 1-D tensor, summed in place.
        across: Sums a shard in place over the other groups (MPI, or the host link).
        buffer: Where the padded whole and the shard go (scratch kept by the caller); new
            tensors where None.
    """
    n, size = t.numel(), group.size
    shard = -(-n // size)
    make = buffer or (lambda numel, _slot: torch.empty(numel, dtype=t.dtype, device=t.device))
    padded = t
    if shard * size != n:
        padded = make(shard * size, 0)
        padded[:n].copy_(t)
        padded[n:].zero_()
    mine = make(shard, 1)
    group.reduce_scatter_(padded, mine)
    across(mine)
    group.allgather_(mine, padded)
    if padded is not t:
        t.copy_(padded[:n])


@dataclass
class HostLink:
    """The cross-node leg of a reduction, cut by host (see the module's docstring).

    Built collectively over the inter-node communicator by :meth:`build`.

    Attributes:
        local: The host group's backend (None where this member is alone on its host).
        leaders: MPI communicator of the host leaders (None on other members, or where the
            communicator lies on one host).
        leader_ranks: World ranks in ``leaders``.
        kind: The device type of the tensors it takes (``cuda`` for NCCL).
        name: The host groups' backend (``nccl``; ``gloo`` in the CPU tests).
        hosts: Hosts the inter-node communicator spans.
        calls: Sums made through it (for tests and the log).
        members: This host group's members, by rank in the inter-node communicator (a
            member's rank in ``local`` is its index here).
        shards: MPI communicator of the members at this member's place on every host (the
            shard form), or None (one host, or hosts with different numbers of members).
        shard_ranks: World ranks in ``shards``.
        plan: How it was built (``inter_ranks``, host of each member, factory): a
            :meth:`twin` over a duplicate communicator repeats it.
    """

    local: IntraBackend | None
    leaders: Any
    leader_ranks: list[int]
    kind: str
    name: str
    hosts: int
    calls: int = 0
    members: list[int] = field(default_factory=list)
    plan: tuple[list[int], list[Any], Factory] | None = None
    shards: Any = None
    shard_ranks: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, inter: Any, watchdog: Watchdog, inter_ranks: list[int],
              hosts: list[Any], kind: str, name: str, factory: Factory) -> HostLink:
        """Split ``inter`` by host and make each host group's backend (collective).

        Args:
            inter: The inter-node communicator.
            watchdog: Deadline keeper of every start-up call.
            inter_ranks: World rank of each member of ``inter``.
            hosts: Host index (or name) of each member of ``inter``, the same list on all.
            kind: Device type of the tensors the host groups take.
            name: The backend ``factory`` makes (for the log).
            factory: Makes a host group's backend (called only for groups of two or more).
        """
        from mpi4py import MPI

        me = inter.Get_rank()
        groups, count = _number(hosts)
        with watchdog.guard("super-learners' host communicator (Split)", inter_ranks):
            local = inter.Split(color=groups[me], key=me)
        members = [i for i, g in enumerate(groups) if g == groups[me]]
        first = local.Get_rank() == 0  # this host's leader
        backend = None
        if local.Get_size() > 1:
            backend = factory(local, watchdog, [inter_ranks[i] for i in members])
        else:
            local.Free()  # alone on its host: its leg is the host leaders' MPI call
        leaders, leader_ranks = None, [inter_ranks[groups.index(g)] for g in range(count)]
        shards, shard_ranks = None, []
        sizes = {groups.count(g) for g in range(count)}
        if count > 1 and len(sizes) == 1 and sizes != {1}:  # equal host groups: shard form
            place = members.index(me)
            with watchdog.guard("super-learners' shard communicator (Split)", inter_ranks):
                shards = inter.Split(color=place, key=me)
            shard_ranks = [inter_ranks[[i for i, g in enumerate(groups) if g == h][place]]
                           for h in range(count)]
        elif count > 1:
            with watchdog.guard("super-learners' host leaders' communicator (Split)",
                                inter_ranks):
                split = inter.Split(color=0 if first else MPI.UNDEFINED, key=me)
            leaders = split if first else None
        return cls(backend, leaders, leader_ranks, kind, name, count, members=members,
                   plan=(inter_ranks, hosts, factory), shards=shards, shard_ranks=shard_ranks)

    def twin(self, inter: Any, watchdog: Watchdog) -> HostLink:
        """The same link over ``inter``, a duplicate of its communicator (collective).

        A channel of its own (:meth:`~hadpsgd.comm.topology.Topology.side_channel` whose
        means run on the caller's thread) needs groups of its own, waited on by its own
        ``watchdog``; a channel driven by a background thread gets none (the module's text,
        *One thread launches NCCL*).
        """
        inter_ranks, hosts, factory = self.plan  # type: ignore[misc] - set by build
        return HostLink.build(inter, watchdog, inter_ranks, hosts, self.kind, self.name,
                              factory)

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s sum goes this way (tensors on the host groups' device type)."""
        return t.device.type == self.kind

    def allreduce_(self, t: torch.Tensor, what: str, mpi_sum: MpiSum) -> None:
        """Sum ``t`` over the inter-node communicator in place, the same bits on every member.

        Args:
            t: A contiguous 1-D tensor this link :meth:`takes`.
            what: The operation, for a deadline's message.
            mpi_sum: The MPI sum of the host leaders' leg (staging what MPI cannot read).
        """
        self.calls += 1
        local = self.local
        if self.hosts == 1:
            local.allreduce_(t)  # type: ignore[union-attr] # one host: a group of >= 2
            return
        if self.shards is not None and local is not None:
            shard_sum_(local, t, lambda mine: mpi_sum(
                self.shards, mine, f"{what} between hosts (shard {local.rank} of {local.size})",
                self.shard_ranks))
            return
        if local is not None:
            local.reduce_(t, root=0)
        if self.leaders is not None:
            mpi_sum(self.leaders, t, f"{what} between hosts", self.leader_ranks)
        if local is not None:
            local.bcast_(t, root=0)

    def communicators(self) -> list[Any]:
        """The MPI communicators this link waits on (a failure revokes them)."""
        found = [x for x in (self.leaders, self.shards) if x is not None]
        if self.local is not None:
            found.append(self.local.comm)
        return found

    def close(self) -> None:
        """Release the host group's backend."""
        if self.local is not None:
            self.local.close()


SCOPE = "super-learners' host group"
"""How the host groups' backends name themselves in a deadline's message."""


def device_host_link(name: str, inter: Any, watchdog: Watchdog, inter_ranks: list[int],
                     labels: list[str], device: torch.device, node_sizes: list[int],
                     nccl_inside: bool, notes: list[str]) -> HostLink | None:
    """NCCL between the super-learners that share a host, where it can run; else None.

    Every rank calls it (collective over ``inter`` where the question arises). It can run
    where the learners compute on GPUs with NCCL, each super-learner's own reductions are
    NCCL's too (``nccl_inside``) or it is one learner, and at least two members of ``inter``
    share a host, each on its own GPU. The members agree over ``inter`` (one of them unable
    leaves them all on MPI: they must cut the leg alike).

    Args:
        name: The chosen intra-node backend: ``mpi`` or ``gloo`` keep every leg off NCCL,
            as does ``HADPSGD_HOST_LINK=0``.
        inter: The inter-node communicator.
        watchdog: Deadline keeper.
        inter_ranks: World rank of each member of ``inter``.
        labels: Every rank's device label (``host:cuda:i:uuid``), by world rank.
        device: This learner's device.
        node_sizes: Learners per super-learner.
        nccl_inside: Whether the super-learners reduce device tensors over NCCL.
        notes: Where a reason the link is off goes, for the start-up log.
    """
    from hadpsgd import env  # noqa: PLC0415 - start-up only
    from hadpsgd.comm.objects import allgather_object  # noqa: PLC0415 - start-up only

    if (device.type != "cuda" or name in ("mpi", "gloo") or len(node_sizes) == 1
            or not env.host_link()):
        return None
    mine = [labels[r] for r in inter_ranks]
    groups, why = plan_host_link([label.partition(":")[0] for label in mine], mine)
    if why.startswith("no two"):
        return None  # the same on every member: each super-learner has a host of its own
    if not why and not (nccl_inside or max(node_sizes) == 1):
        why = "the super-learners' own reductions are not on NCCL"
    if not why:
        from hadpsgd.comm.nccl import nccl_available  # noqa: PLC0415 - CUDA only

        ok, reason = nccl_available()
        why = "" if ok else reason
    reasons = sorted({w for w in allgather_object(inter, watchdog, why, inter_ranks) if w})
    if reasons:
        notes.append(f"super-learners that share a host exchange through MPI: "
                     f"{'; '.join(reasons)}")
        return None

    def nccl(comm: Any, guard: Watchdog, members: list[int]) -> IntraBackend:
        from hadpsgd.comm.nccl import NCCLIntra  # noqa: PLC0415 - CUDA only

        return NCCLIntra(comm, guard, members, device, scope=SCOPE)

    link = HostLink.build(inter, watchdog, inter_ranks, groups, "cuda", "nccl", nccl)
    notes.append(f"super-learners that share a host exchange over NCCL ({link.hosts} "
                 f"host{'s' if link.hosts > 1 else ''}, MPI between hosts)")
    return link


__all__ = ["SCOPE", "Buffer", "HostLink", "device_host_link", "plan_host_link", "shard_sum_"]
