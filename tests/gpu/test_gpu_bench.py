"""The GPU modes of the comm and throughput benchmarks on 2 ranks (skipped without CUDA).

With one GPU the two ranks share it: hadpsgd then stages device tensors through host memory
(NCCL needs a GPU per rank) and DDP runs over gloo on the CUDA tensors; with two GPUs both
take NCCL. Either way every row must carry positive ratios against its same-run baseline.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests._mpi import ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUICK = ["--max-bytes", "4096", "--iters", "2", "--warmup", "1", "--max-time", "0.01"]


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HADPSGD_TIMEOUT="60")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
        env.pop(name, None)  # the drivers must launch their own ranks
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\n{err.stdout}\n{err.stderr}")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_comm_benchmark_on_cuda(tmp_path):
    out = tmp_path / "comm.json"
    res = _run([sys.executable, "-m", "benchmarks.comm", "-n", "2", "--device", "cuda",
                "--op", "all", *QUICK, "--json", str(out)])
    record = json.loads(out.read_text())
    device = record["device"]
    assert device["type"] == "cuda" and record["options"]["device"] == "cuda"
    assert set(device["route"]) == {"intra", "inter"}
    assert isinstance(device["cuda_aware"], bool)
    assert record["options"]["gloo"] is False  # no gloo baseline on device tensors
    rows = record["rows"]
    names = {r["name"] for r in rows}
    assert {"allreduce/flat", "broadcast", "exchange",
            f"intra/{device['intra_backend']}"} <= names
    assert not any("gloo" in name for name in names)
    for r in rows:
        assert _positive(r["time_us"]) and _positive(r["ratio"]), r
        assert r["gloo_ratio"] is None
        assert "device_ratio" in r and "route" in r
        if device["cuda_aware"]:
            assert _positive(r["device_ratio"]), r
        else:
            assert r["device_ratio"] is None
        if r["op"] in ("allreduce", "intra"):
            assert set(r["route"]) == {"intra", "inter"}
    summary = record["summary"]
    assert summary["device"] == "cuda"
    assert "mpi4py+cp" in res.stdout and "mpi4py-dev" in res.stdout


def test_throughput_benchmark_on_cuda(tmp_path):
    out = tmp_path / "tt.json"
    res = _run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"),
                "--device", "cuda", "--presets", "tiny", "--ranks", "2", "--batch", "4",
                "--classes", "8", "--steps", "2", "--warmup", "1", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["device"] == "cuda"
    rows = {r["mode"]: r for r in record["rows"]}
    # On CUDA the default SSGD overlaps its reductions with backward; ssgd-serial is the
    # same run reducing after backward (the CPU default), measured beside it.
    assert sorted(rows) == ["ddp", "plain", "ssgd", "ssgd-serial"]
    assert all(r["device"] == "cuda" for r in rows.values())
    shared = torch.cuda.device_count() < 2
    assert rows["ddp"]["backend"] == ("gloo" if shared else "nccl")
    for r in rows.values():
        assert _positive(r["sec_per_step"]) and _positive(r["ratio_vs_plain"]), r
    assert _positive(rows["ssgd"]["time_vs_ddp"])
    assert "t/t_ddp" in res.stdout


def test_graph_probe_captures_the_whole_step(tmp_path):
    # One small batch: the captured step, and the captured model, replay (no error recorded)
    # and are timed beside the eager step of the same run.
    out = tmp_path / "graph.json"
    _run([sys.executable, "-m", "benchmarks.training.graph_probe", "--preset", "small",
          "--classes", "50", "--feat-dim", "40", "--batch", "16", "--window", "2",
          "--windows", "2", "--json", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    for variant in ("graph", "model_graph"):  # the whole step, and the model's passes alone
        assert "error" not in row[variant], row[variant]
        assert _positive(row[variant]["frames_per_s"])
        assert _positive(row[f"{variant}_over_eager"])
