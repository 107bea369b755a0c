"""GPU paths of the communication layer: NCCL inside a node, host staging between nodes.

Skipped without CUDA. NCCL needs one device per rank of a node, so the NCCL test needs two
GPUs; the staging tests run on one.
"""

import pytest
import torch

from tests.conftest import assert_ok, run_worker

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_staging_pipeline_on_device():
    import numpy as np

    from hadpsgd.comm.staging import Stager

    t = torch.arange(10_001, dtype=torch.float32, device="cuda")
    seen = []

    def op(buf: np.ndarray) -> None:
        seen.append(buf.size)
        buf += 1

    Stager().run_staged(t, bucket_elems=1000, op=op)
    assert seen == [1000] * 10 + [1]
    assert torch.equal(t.cpu(), torch.arange(10_001, dtype=torch.float32) + 1)


def test_staged_inter_node_allreduce_on_cuda():
    # Two emulated nodes of one rank each: only the inter-node MPI path, staged through host.
    res = run_worker(2, "comm_ops", env={"HADPSGD_RANKS_PER_NODE": "1", "HADPSGD_CUDA_AWARE": "0",
                                         "HADPSGD_TEST_DEVICE": "cuda"})
    assert_ok(res)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL test needs 2 GPUs")
def test_nccl_intra_node():
    pytest.importorskip("cupy")
    res = run_worker(4, "comm_ops", env={"HADPSGD_RANKS_PER_NODE": "2",
                                         "HADPSGD_INTRA_BACKEND": "nccl",
                                         "HADPSGD_TEST_DEVICE": "cuda"})
    assert_ok(res)
