"""The two-level communication layer under real mpirun, on emulated node layouts.

Layout ``NxK`` is N emulated nodes of K consecutive ranks (``HADPSGD_RANKS_PER_NODE=K``).
"""

import re
import time

import pytest

from tests._commands import run_command, run_worker_warm
from tests._mpi import assert_ok, run_worker

pytestmark = pytest.mark.mpi

# A bucket of ~100 bytes: 1001 floats span many buckets, the last one partial, and bucket
# lengths are not multiples of the node size, so padding and bucketing are both exercised.
TINY_BUCKET = {"HADPSGD_BUCKET_MB": "0.0001"}


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 3), (1, 4)])
def test_hierarchical_equals_flat(nodes, per_node):
    # Both host backends inside a node, one after the other in one launch (each its own
    # topology): MPI's shared memory, then gloo (NCCL's stand-in).
    n = nodes * per_node
    res = run_worker_warm(n, "comm_ops", env={**TINY_BUCKET,
                                              "HADPSGD_RANKS_PER_NODE": str(per_node),
                                              "COMM_OPS_BACKENDS": "mpi,gloo"})
    assert_ok(res)
    # Counted as substrings, not per line: MPICH's Hydra may merge two ranks' lines.
    assert res.stdout.count("OK rank") == 2 * n, res.stdout
    assert f"{nodes} emulated node" in res.stdout, res.stdout
    for backend in ("mpi", "gloo"):
        assert res.stdout.count(f"intra-node {backend} (") == n, res.stdout


def test_intra_group_spanning_hosts_meets_over_a_tcp_store():
    # A node whose learners sit on two hosts (super-learner larger than a host): the gloo /
    # NCCL group cannot meet through a FileStore in one host's /tmp; it must take the TCP
    # store whose address rank 0 broadcasts over MPI, and every collective still be exact.
    res = run_worker_warm(4, "comm_ops_spanning", env={**TINY_BUCKET,
                                                       "HADPSGD_RANKS_PER_NODE": "2",
                                                       "HADPSGD_INTRA_BACKEND": "gloo"})
    assert_ok(res)
    assert res.stdout.count("OK rank") == 4 and "intra-node gloo" in res.stdout
    assert all(f"rendezvous rank {r}: tcp" in res.stdout for r in range(4)), res.stdout


def test_leader_form_and_unequal_nodes():
    # 5 ranks in nodes of 2 -> sizes [2, 2, 1]: only the leader form can work there.
    res = run_worker_warm(5, "comm_ops", env={**TINY_BUCKET, "HADPSGD_RANKS_PER_NODE": "2"})
    assert_ok(res)
    assert "[2, 2, 1]" in res.stdout and "leader hierarchy" in res.stdout


@pytest.mark.parametrize("nprocs", [2, 3])
def test_flat_world(nprocs):
    res = run_worker_warm(nprocs, "comm_ops")
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs


@pytest.mark.parametrize(("nprocs", "per_node", "path"), [
    (3, None, None), (4, "2", None),
    (2, None, "flat"), (3, None, "auto")])  # the last two: the direct one-call path
def test_missing_peer_is_named_within_deadline(nprocs, per_node, path):
    env = {"HADPSGD_TIMEOUT": "4"}
    if per_node:
        env["HADPSGD_RANKS_PER_NODE"] = per_node
    if path:
        env["DEADLINE_PATH"] = path
    start = time.monotonic()
    res = run_worker(nprocs, "deadline", env=env, timeout=150)
    elapsed = time.monotonic() - start
    assert res.returncode != 0 and "NO TIMEOUT" not in res.stdout
    # rank 0 sleeps 60 s: only the deadline (4 s + diagnosis grace) can end the job that soon
    assert elapsed < 40, res.output
    errors = re.findall(r"hadpsgd: error: rank (\d): (.*)", res.stderr)
    assert {int(r) for r, _ in errors} == set(range(1, nprocs)), res.output
    for _, msg in errors:
        assert "rank(s) 0 never arrived" in msg and "HADPSGD_TIMEOUT" in msg, msg


@pytest.mark.parametrize("nprocs", [2, 3])
def test_shared_counter_hands_out_each_ticket_once(nprocs):
    res = run_worker_warm(nprocs, "shared_counter")
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs


def test_machine_check_reports_the_machine():
    """``python -m hadpsgd.comm`` under mpirun: the MPI library, thread level, CUDA-awareness,
    the ranks per host; a bad HADPSGD_* value is a problem (exit 1)."""
    res = run_command(2, ["-m", "hadpsgd.comm"])
    assert res.returncode == 0, res.output[-2000:]
    for phrase in ("[hadpsgd.comm] MPI library:", "MPI world: 2 rank(s), thread level",
                   "CUDA-aware MPI:", "torch:", "2 rank(s), GPUs visible per rank"):
        assert phrase in res.stdout, res.stdout
    res = run_command(2, ["-m", "hadpsgd.comm"], env={"HADPSGD_TIMEOUT": "soon"})
    assert res.returncode != 0
    assert "problem: HADPSGD_TIMEOUT='soon' is not a number" in res.stdout


def test_machine_check_keeps_its_old_name():
    """``python -m hadpsgd.env`` (the check's older name) runs the same check, exit code too."""
    res = run_command(1, ["-m", "hadpsgd.env"])
    assert res.returncode == 0, res.output[-2000:]
    assert "[hadpsgd.comm] MPI world: 1 rank(s), thread level" in res.stdout, res.stdout
    res = run_command(1, ["-m", "hadpsgd.env"], env={"HADPSGD_TIMEOUT": "soon"})
    assert res.returncode != 0
    assert "problem: HADPSGD_TIMEOUT='soon' is not a number" in res.stdout


@pytest.mark.parametrize(("nprocs", "per_node", "hosts"), [
    (4, "2", "1"),   # 2 super-learners of 2 on one host: one group allreduce per leg
    (4, "1", "2"),   # 4 of 1 on 2 hosts: the shard form (reduce-scatter, MPI, allgather)
    (6, "1", "2"),   # 6 of 1 on 2 hosts: the shard form with shards of a third, padded
    (5, "2", "2"),   # [2, 2, 1] on 2 hosts: the leader form, a host holding one super-learner
])
def test_cross_node_leg_cut_by_host(nprocs, per_node, hosts):
    # Issue 44 item 3: where super-learners share a host their exchanges take the host's
    # torch.distributed group (NCCL on GPUs; gloo stands in here, the same TorchIntra
    # calls), MPI only between hosts. Every collective of comm_ops must still equal its
    # NumPy reference and be bit-identical on every rank, with the leg taken through the link.
    res = run_worker_warm(nprocs, "host_link", env={**TINY_BUCKET,
                                                    "HADPSGD_RANKS_PER_NODE": per_node,
                                                    "HOST_LINK_HOSTS": hosts})
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs
    assert "inter-node gloo between super-learners of one host" in res.stdout
    calls = {int(m.group(1)): int(m.group(2))
             for m in re.finditer(r"link rank (\d+) hosts \d+ calls (\d+)", res.stdout)}
    assert len(calls) == nprocs and calls[0] > 0, res.stdout
    if hosts != "1":  # the hosts' leg: every member's shard where the hosts hold as many
        form = "shard True" if nprocs % 2 == 0 else "leader True"  # (issue 59 item 7)
        assert form in res.stdout and "between hosts" in res.stdout, res.stdout
    if per_node == "1":  # the block average's channel: a twin link of its own on the caller's
        # thread, MPI where its background thread runs the means (one thread launches NCCL)
        assert res.stdout.count("ok True") == nprocs, res.stdout


def test_ranks_with_different_settings_are_refused_alike_before_any_acts():
    """Rank 1's own HADPSGD_INTRA_BACKEND (gloo, the others mpi) once sent it alone into
    gloo's rendezvous, waiting out the deadline: the ranks agree on their settings first
    and every rank refuses, naming the setting and the rank (issue 59, item 6)."""
    res = run_worker(3, "settings_differ", env={"HADPSGD_TIMEOUT": "20"}, timeout=120)
    assert "NO REFUSAL" not in res.stdout, res.output[-3000:]
    lines = _refusals(res.stdout)
    assert sorted(int(r) for r, _ in lines) == [0, 1, 2], res.output[-3000:]
    for _, msg in lines:
        assert ("disagree on the intra-node backend" in msg and "rank 0 has 'mpi'" in msg
                and "rank 1 'gloo'" in msg and "rank 2" not in msg), msg


def test_the_shared_gpu_test_mode_is_refused_on_cpu_by_every_rank():
    """HADPSGD_SHARE_GPU (ranks on one GPU as GPUs of their own, issue 59) means nothing on
    CPU: every rank refuses at start, naming the variable and the fix."""
    res = run_worker(2, "settings_differ", env={"HADPSGD_SHARE_GPU": "1",
                                                "HADPSGD_TIMEOUT": "20"}, timeout=120)
    lines = _refusals(res.stdout)
    assert sorted(int(r) for r, _ in lines) == [0, 1], res.output[-3000:]
    for _, msg in lines:
        assert "HADPSGD_SHARE_GPU=1" in msg and "on cpu: unset it" in msg, msg


def _refusals(out: str) -> list[tuple[str, str]]:
    """Each ``REFUSED rank r: message`` of the worker, (r, message). MPICH's Hydra may join
    two ranks' lines into one: a message ends at the next rank's marker or at its line's end."""
    parts = re.split(r"REFUSED rank (\d): ", out)[1:]
    return [(rank, msg.split("\n")[0]) for rank, msg in zip(parts[::2], parts[1::2],
                                                             strict=True)]
