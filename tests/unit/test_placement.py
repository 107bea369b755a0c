"""Device binding by the physical host, and launches that are N separate one-rank jobs."""

import pytest

from hadpsgd.comm.placement import gpu_index, singleton_launch, summarize


def test_gpu_follows_the_host_rank_not_the_emulated_node():
    # 8 ranks on one 8-GPU host, whatever --ranks-per-node groups them into: 8 GPUs.
    assert [gpu_index(r, 8, 8) for r in range(8)] == list(range(8))
    # Two 8-GPU hosts with 8 ranks each: host ranks restart at 0 on the second host.
    assert [gpu_index(r % 8, 8, 8) for r in range(16)] == list(range(8)) * 2


def test_one_visible_gpu_per_process_is_device_zero():
    # srun --gpus-per-task=1 / per-rank CUDA_VISIBLE_DEVICES: each process sees one GPU.
    assert [gpu_index(r, 8, 1) for r in range(8)] == [0] * 8


def test_more_ranks_than_gpus_share_round_robin():
    assert [gpu_index(r, 4, 2) for r in range(4)] == [0, 1, 0, 1]


def test_gpu_index_rejects_nonsense():
    with pytest.raises(ValueError, match="no GPU"):
        gpu_index(0, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        gpu_index(4, 4, 8)


@pytest.mark.parametrize("var, launcher", [("SLURM_STEP_NUM_TASKS", "srun"),
                                           ("OMPI_COMM_WORLD_SIZE", "Open MPI"),
                                           ("PMI_SIZE", "PMI"),
                                           ("WORLD_SIZE", "torchrun")])
def test_singleton_launch_is_named_with_the_fix(var, launcher):
    msg = singleton_launch(1, {var: "8"})
    assert msg is not None and launcher in msg and f"{var}=8" in msg and "Fix:" in msg


def test_real_jobs_and_single_runs_are_not_flagged():
    assert singleton_launch(8, {"SLURM_STEP_NUM_TASKS": "8"}) is None
    assert singleton_launch(1, {"SLURM_STEP_NUM_TASKS": "1"}) is None
    assert singleton_launch(1, {}) is None
    assert "--mpi=pmix" in singleton_launch(1, {"SLURM_STEP_NUM_TASKS": "4"})


def test_summary_groups_ranks_by_host():
    labels = ["a:cuda:0:GPU-1", "a:cuda:1:GPU-2", "b:cuda:0:GPU-3", "b:cpu"]
    assert summarize(labels) == "a [0>cuda:0 1>cuda:1]; b [2>cuda:0 3>cpu]"


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"])
def test_launcher_local_rank_before_mpi(var):
    from hadpsgd.comm.placement import launcher_local_rank

    assert launcher_local_rank({var: "3"}) == 3
    assert launcher_local_rank({var: ""}) is None and launcher_local_rank({}) is None
    # Open MPI's own variable wins over a stale Slurm one (mpirun inside an allocation).
    assert launcher_local_rank({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}) == 5


@pytest.mark.parametrize("emulated, hosts, node_sizes, said", [
    (True, ["a", "a", "b", "b"], [2, 2], None),            # an emulated node a host
    (True, ["a", "b", "c", "d"], [2, 2], "2"),             # a site of 2 hosts each
    (True, ["a", "a", "b", "b", "c", "c"], [3, 3], "2"),   # 2 hosts each, b in both
    (True, ["a", "a", "a", "b", "c", "d"], [3, 3], "1/3"),  # one site on one host
    (False, ["a", "b", "c", "d"], [1, 1, 1, 1], None),      # real nodes are hosts
    (True, [], [2, 2], None),                               # hosts unknown: nothing said
])
def test_a_super_learner_across_hosts_is_named_a_site(emulated, hosts, node_sizes, said):
    from types import SimpleNamespace

    from hadpsgd.comm.topology import Topology

    topo = SimpleNamespace(emulated=emulated, hosts=hosts, size=sum(node_sizes),
                           node_sizes=node_sizes)
    assert Topology.sites(topo) == said  # type: ignore[arg-type]
