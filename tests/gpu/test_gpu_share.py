"""NCCL between two ranks through the main command, against the MPI route of the same run.

Needs two GPUs, or one in the shared-GPU test mode (``HADPSGD_SHARE_GPU``: each rank a GPU of
its own, NCCL over sockets on loopback; ``scripts/gpu_check.sh --part 3``), so that the
NCCL paths the machines lent here never ran (issue 59) run on one GPU: NCCL inside a node
(SSGD's gradient buckets on the bf16 wire) and NCCL between super-learners that share a host
(BMUF's block averages on the host link, blocking and overlapped). Each is checked
against the same run with MPI on that leg: the same losses to rounding. Timings in the
shared mode mean nothing and are not read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._mpi import assert_ok, run_mpi
from tests.gpu._gpus import nccl_gpus
from tests.mpi._resume import run_args

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              nccl_gpus(2)]


def _losses(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["kind"] == "train"] + [
        x["heldout_loss"] for x in lines if x["kind"] == "eval"]


def _pair(tiny_data: tuple[Path, Path], tmp_path: Path, args: list[str], nccl: dict[str, str],
          mpi: dict[str, str], mpi_args: list[str]) -> tuple[str, list[float], list[float]]:
    common = ["--device", "cuda", "--batch-size", "4", "--max-steps", "24", "--log-every", "2",
              *args]
    got = run_mpi(2, run_args(tiny_data, tmp_path / "nccl", *common), env=nccl)
    assert_ok(got)
    ref = run_mpi(2, run_args(tiny_data, tmp_path / "mpi", *common, *mpi_args), env=mpi)
    assert_ok(ref)
    return got.output, _losses(tmp_path / "nccl"), _losses(tmp_path / "mpi")


def test_ssgd_over_nccl_inside_a_node_follows_the_mpi_route(tiny_data, tmp_path):
    """Two ranks as one node: the gradient buckets on NCCL (bf16 on the wire) against
    --intra-backend mpi with the same wire."""
    out, nccl, mpi = _pair(tiny_data, tmp_path, ["--algo", "ssgd", "--ranks-per-node", "2",
                                                 "--grad-wire", "bf16"], {}, {},
                           ["--intra-backend", "mpi"])
    assert "intra-node nccl" in out, out[-3000:]
    # The start-up line counts the NCCL communicator and the device memory it took
    assert "torch.distributed group" in out and "GiB of device memory at set-up" in out, out[-3000:]
    assert len(nccl) == len(mpi) > 4
    assert nccl == pytest.approx(mpi, rel=2e-3)


@pytest.mark.parametrize("overlap", [[], ["--bmuf-overlap"]], ids=["blocking", "overlapped"])
def test_bmuf_over_the_host_link_follows_mpi_between_nodes(overlap, tiny_data, tmp_path):
    """Two super-learners of one rank on one host: the block averages on the host link's NCCL
    group (blocking, on the main thread; overlapped, the side channel's thread takes MPI,
    only the main thread launching NCCL) against HADPSGD_HOST_LINK=0."""
    out, nccl, mpi = _pair(tiny_data, tmp_path, ["--algo", "bmuf", "--ranks-per-node", "1",
                                                 "--sync-period", "3", *overlap],
                           {}, {"HADPSGD_HOST_LINK": "0"}, [])
    assert "nccl between super-learners of one host" in out, out[-3000:]
    assert len(nccl) == len(mpi) > 4
    assert nccl == pytest.approx(mpi, rel=2e-3)
