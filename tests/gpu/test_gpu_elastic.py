"""``--on-failure continue`` on CUDA, under ``python -m hadpsgd.launch`` (ULFM).

Skipped without CUDA. With NCCL inside a node a dead learner's node-mates would stay in a
kernel that never ends (nothing aborts the communicator before the survivors' shrink), so
that combination is refused at start naming ``--intra-backend mpi``; with two or more GPUs
the refusal itself runs. The fix it names, device tensors staged through host memory and
reduced by MPI, goes on through a killed learner (on one GPU the ranks share it and take
that path anyway). The CPU suite runs the same sequence with gloo
(``tests/mpi/test_elastic.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._gpus import nccl_gpus
from tests.mpi.test_elastic import _launch, _records

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@nccl_gpus(2)  # NCCL needs a GPU per rank (or HADPSGD_SHARE_GPU)
def test_nccl_inside_a_node_is_refused_under_continue(tiny_data, tmp_path):
    """Two learners on two GPUs of one node (NCCL): exit 2 before training, naming NCCL,
    the kernel that never ends and the fix."""
    res = _launch(2, tiny_data, tmp_path / "run", "--device", "cuda", "--max-steps", "4")
    assert res.returncode == 2, res.output[-4000:]
    assert "with nccl inside a node" in res.stderr and "an NCCL kernel that never ends" \
        in res.stderr and "Use --intra-backend mpi" in res.stderr, res.output[-4000:]


def test_staged_mpi_inside_a_node_goes_on_through_a_killed_learner(tiny_data, tmp_path):
    """--intra-backend mpi on CUDA (the refusal's fix): rank 1 of 2 is SIGKILLed at step 6,
    the survivor goes on alone from the control point to the end, exit 0."""
    out = tmp_path / "run"
    res = _launch(2, tiny_data, out, "--device", "cuda", "--intra-backend", "mpi",
                  "--max-steps", "16", "--control-every", "5",
                  fault="kind=kill,rank=1,step=6")
    assert res.returncode == 0, res.output[-4000:]
    assert "device cuda" in res.stdout and "1 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["lost"] == [1] and failure["learners"] == 1
    assert _records(out, "eval")[-1]["step"] == 16
