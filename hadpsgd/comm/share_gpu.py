"""Ranks that share one GPU, run as if each had its own: a test mode (``HADPSGD_SHARE_GPU``).

The machines lent to this project have one GPU, so no NCCL path between two ranks had ever
run (issue 59). NCCL refuses two ranks of one host on one device (its duplicate-GPU check
compares each rank's host hash and bus id), and hadpsgd's own checks send ranks that share a
GPU down the host-staged route. The host hash comes from ``NCCL_HOSTID`` where it is set, so
with a distinct one per rank and NCCL's socket transport over loopback, two to four ranks on
one GPU form real NCCL communicators (public projects test this way; ~15 ms a collective).

``HADPSGD_SHARE_GPU=K`` (K >= 1) turns that on for every rank of a job on one machine:

- each rank's device label gets its rank, so hadpsgd's refusals and routes treat each rank as
  a GPU of its own (NCCL inside a node, the host link between super-learners);
- the ranks are cut into K pretend hosts of consecutive ranks (the host part of the label), so
  that a host holds several super-learners (the host link) or one (MPI between hosts);
- before any NCCL communicator exists, each rank gets its own ``NCCL_HOSTID`` and NCCL's
  socket transport on loopback (``NCCL_NET=Socket``, ``NCCL_SOCKET_IFNAME=lo``,
  ``NCCL_IB_DISABLE=1``; a value the user set is kept, but for the host id).

It proves the paths and their bits, never their speed: no NVLink, no concurrency between the
ranks' kernels (they share one GPU), sockets instead of the real transports. The start says
so, and so must every report of its results. It is refused on CPU and across machines.
"""

from __future__ import annotations

import os

NCCL_SOCKETS = {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
"""NCCL's transport between the pretend GPUs: sockets on loopback (kept where already set)."""


def label(device_label: str, rank: int, size: int, hosts: int) -> str:
    """``device_label`` (``host:cuda:i:uuid``) as the shared-GPU mode sees rank ``rank``.

    Args:
        device_label: The rank's :func:`~hadpsgd.comm.placement.device_label`.
        rank: Its world rank.
        size: The world's size.
        hosts: The pretend hosts (``HADPSGD_SHARE_GPU``): rank r is on ``r * hosts // size``.

    Returns:
        ``host~h:cuda:i:uuid:rR``: a host of its own per pretend host, a GPU of its own per rank.
    """
    host, _, rest = device_label.partition(":")
    return f"{host}~{rank * hosts // size}:{rest}:r{rank}"


def problem(device_type: str, host_size: int, size: int, hosts: int) -> str | None:
    """Why the shared-GPU mode cannot run here, or ``None``.

    Args:
        device_type: The ranks' device (``cuda`` or ``cpu``).
        host_size: Ranks on this physical machine.
        size: Ranks in the job.
        hosts: The pretend hosts asked for.
    """
    name = "HADPSGD_SHARE_GPU"
    if device_type != "cuda":
        return (f"{name}={hosts} runs ranks that share one GPU as GPUs of their own, but this "
                f"run is on {device_type}: unset it (or run with --device cuda)")
    if host_size != size:
        return (f"{name}={hosts} pretends hosts on one machine, but the {size} ranks span "
                f"several ({host_size} on this one): unset it on a real cluster")
    if hosts > size:
        return (f"{name}={hosts} asks for more pretend hosts than the {size} ranks: set it to "
                f"1..{size}")
    return None


def set_nccl_environment(rank: int) -> None:
    """Give this rank a host id of its own and NCCL's sockets on loopback (before NCCL starts).

    A host id set by the user is extended, not kept: shared by every rank it would make
    NCCL see the duplicate GPU again.
    """
    base = os.environ.get("NCCL_HOSTID", "hadpsgd-share")
    os.environ["NCCL_HOSTID"] = f"{base}-rank{rank}"
    for key, value in NCCL_SOCKETS.items():
        os.environ.setdefault(key, value)


def note(size: int, hosts: int) -> str:
    """The start-up note of the mode: what it is, and what its results cannot show."""
    return (f"HADPSGD_SHARE_GPU={hosts}: TEST MODE. The {size} ranks share one GPU but run as "
            f"{size} GPUs on {hosts} pretend host(s), NCCL over sockets on loopback: the paths "
            "and their bits are real, their speed is not (no NVLink, no concurrent kernels); "
            "never report its timings")
