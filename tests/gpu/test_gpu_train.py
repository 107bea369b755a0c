"""Every algorithm end to end on CUDA through ``python -m hadpsgd.run``, under real mpirun.

Skipped without CUDA. On one GPU the ranks share it and the intra-node path is host-staged
MPI (NCCL refuses two ranks on one GPU); with two or more GPUs the NCCL path runs too. The
checks are results, not just exit codes: SSGD equals the big-batch single process, ADPSGD
conserves the sum of replicas, a resumed run continues where it stopped, and faults end in
the named error within the deadline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests._mpi import assert_ok, run_mpi, run_worker
from tests.mpi._resume import final_state, run_args

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ALGOS = {
    "ssgd": (2, []),
    "bmuf-adam": (2, ["--algo", "bmuf", "--ranks-per-node", "1", "--sync-period", "3",
                      "--optimizer", "adam", "--lr", "0.003", "--beta1", "0.5"]),
    "adpsgd": (2, ["--algo", "adpsgd", "--super-learner-size", "1"]),
    "h-adpsgd": (4, ["--algo", "adpsgd", "--super-learner-size", "2"]),
}


def _cuda(data: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    return run_args(data, out, "--device", "cuda", "--batch-size", "4", *extra)


def _evals(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "eval"]


@pytest.mark.parametrize("name", list(ALGOS))
def test_trains_evaluates_checkpoints_and_resumes_on_cuda(name, tiny_data, tmp_path):
    nprocs, extra = ALGOS[name]
    out = tmp_path / name
    res = run_mpi(nprocs, _cuda(tiny_data, out, "--epochs", "2", *extra))
    assert_ok(res)
    assert "device cuda" in res.stdout
    evals = _evals(out)
    assert [e["epoch"] for e in evals] == [0, 0, 1] and evals[0]["step"] == 0
    assert all(e["heldout_loss"] == e["heldout_loss"] for e in evals)  # finite, not NaN
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["world"]["device"].startswith("cuda")
    first = final_state(out)["progress"]["global_step"]
    # --resume auto continues from the checkpoint for one more epoch.
    res = run_mpi(nprocs, _cuda(tiny_data, out, "--epochs", "3", "--resume", "auto", *extra))
    assert_ok(res)
    assert "resumed from" in res.stdout
    assert final_state(out)["progress"]["global_step"] > first
    assert [e["epoch"] for e in _evals(out)][-1] == 2


def test_ssgd_on_cuda_equals_big_batch_single_process(tiny_data, tmp_path):
    common = ("--max-steps", "5", "--optimizer", "sgd", "--momentum", "0.9",
              "--warmup-epochs", "0")
    assert_ok(run_mpi(2, run_args(tiny_data, tmp_path / "multi", "--device", "cuda",
                                  "--batch-size", "4", *common)))
    assert_ok(run_mpi(1, run_args(tiny_data, tmp_path / "single", "--device", "cuda",
                                  "--batch-size", "8", *common)))
    multi, single = final_state(tmp_path / "multi"), final_state(tmp_path / "single")
    for name, p in single["model"].items():
        q = multi["model"][name]
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5), (name, (p - q).abs().max())


@pytest.mark.parametrize(("n", "per_node"), [(2, 1), (4, 2)])
def test_adpsgd_conserves_mass_on_cuda(n, per_node, tmp_path):
    res = run_worker(n, "adpsgd_props", "conserve", str(tmp_path),
                     env={"HADPSGD_RANKS_PER_NODE": str(per_node), "HADPSGD_TIMEOUT": "60",
                          "ADPSGD_TEST_STEPS": "40", "HADPSGD_TEST_DEVICE": "cuda"})
    assert_ok(res)
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    w0 = torch.tensor(recs[0]["w0"], dtype=torch.float64)
    total = sum(torch.tensor(x["flat"], dtype=torch.float64) for x in recs)
    expected = n * w0 - recs[0]["lr"] * recs[0]["steps"] * sum(x["g"] for x in recs)
    assert float((total - expected).norm() / expected.norm()) < 1e-5
    assert sum(x["exchanges"] for x in recs) > 0
    assert all(x["identical"] for x in recs)


def test_graceful_stop_on_cuda_checkpoints_and_resumes(tiny_data, tmp_path):
    out = tmp_path / "stop"
    res = run_mpi(2, _cuda(tiny_data, out, "--epochs", "2", "--control-every", "2"),
                  env={"HADPSGD_FAULT": "kind=signal,rank=1,step=5"})
    assert res.returncode == 75, res.output[-3000:]
    assert "stop requested" in res.stdout
    res = run_mpi(2, _cuda(tiny_data, out, "--epochs", "2", "--control-every", "2",
                           "--resume", "auto"))
    assert_ok(res)


def test_nonfinite_steps_on_cuda_are_skipped_then_stop(tiny_data, tmp_path):
    res = run_mpi(2, _cuda(tiny_data, tmp_path / "nan", "--max-steps", "20",
                           "--max-nonfinite", "2", "--control-every", "5"),
                  env={"HADPSGD_FAULT": "kind=nan,rank=1,step=3,count=5"})
    assert res.returncode != 0
    assert "more than --max-nonfinite 2" in res.stderr and "step 3 on rank 1" in res.stderr


def test_hung_rank_is_named_on_cuda(tiny_data, tmp_path):
    start = time.monotonic()
    res = run_mpi(2, _cuda(tiny_data, tmp_path / "hang", "--epochs", "2"),
                  env={"HADPSGD_TIMEOUT": "5", "HADPSGD_FAULT": "kind=hang,rank=1,step=6"},
                  timeout=180)
    assert res.returncode != 0
    assert "rank(s) 1 never arrived" in res.output, res.output[-3000:]
    assert time.monotonic() - start < 120


def test_batches_are_pinned_and_copied_asynchronously(tiny_data):
    # A CUDA learner's batches come in page-locked memory (make_loader(pin_memory=True)),
    # so the loop's non_blocking copies to the GPU are really asynchronous.
    from hadpsgd.data import ChunkBatchSampler, ChunkDataset, make_loader

    ds = ChunkDataset(tiny_data[0], chunk_len=21)
    loader = make_loader(ds, ChunkBatchSampler(len(ds), 4, 0, 1, seed=0), pin_memory=True)
    feats, labels = next(iter(loader))
    assert feats.is_pinned() and labels.is_pinned()
    on_gpu = feats.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), feats)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["ssgd", "bmuf-adam", "h-adpsgd"])
def test_mixed_precision_on_cuda(name, precision, tiny_data, tmp_path):
    """bf16 and fp16 (with its loss scale) through the main command on CUDA, with bf16 on
    the gradient wire: finite held-out figures, and fp16's scale in the log."""
    nprocs, extra = ALGOS[name]
    out = tmp_path / f"{name}-{precision}"
    res = run_mpi(nprocs, _cuda(tiny_data, out, "--max-steps", "30", "--log-every", "5",
                                "--precision", precision, "--grad-wire", "bf16", *extra))
    assert_ok(res)
    assert all(e["heldout_loss"] == e["heldout_loss"] for e in _evals(out))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert train and ("loss_scale" in train[-1]) == (precision == "fp16")
