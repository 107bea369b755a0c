"""BatchNorm's buffers kept in agreement with the model on CUDA (skipped without CUDA).

The worker of tests/mpi/test_buffers.py on the topology's device: the buffers' memory on the
GPU (cuDNN's BatchNorm updating its views in place), broadcast and averaged through the
device routes (4 ranks sharing one GPU: staged through host memory; a GPU each: NCCL inside
a node).
"""

from __future__ import annotations

import pytest
import torch

from tests._mpi import assert_ok, run_worker

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_batchnorm_buffers_agree_on_the_gpu():
    res = run_worker(4, "api_buffers", env={"HADPSGD_RANKS_PER_NODE": "2"})
    assert_ok(res)
    for phase in ("ssgd", "bmuf", "adpsgd", "off"):
        assert res.stdout.count(f"OK {phase} rank") == 4, res.output[-4000:]
