"""The training-throughput benchmark end to end under real mpirun: hadpsgd SSGD against DDP."""

import json
import math
import subprocess
import sys

import pytest

from tests._mpi import ROOT

pytestmark = pytest.mark.mpi

SCRIPT = str(ROOT / "benchmarks" / "train_throughput.py")
TINY = ["--presets", "tiny", "--batch", "4", "--classes", "8", "--steps", "2", "--warmup", "1"]


def run_driver(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the driver (it starts its own mpirun jobs), failing on a hang."""
    try:
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"train_throughput {' '.join(args)} did not finish in {timeout} s\n"
                    f"stdout:\n{err.stdout}\nstderr:\n{err.stderr}")


@pytest.fixture(scope="module")
def both_precisions(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One run of the driver for both tests: fp32 and bf16, SSGD with bf16 on the wire (its
    seven jobs of one and two ranks are most of the lab's time; the record names each row's
    wire, and the summary's names without a wire are tested in test_bench_comm.py)."""
    out = tmp_path_factory.mktemp("throughput") / "tt.json"
    res = run_driver([*TINY, "--ranks", "2", "--precision", "fp32", "bf16", "--grad-wire",
                      "bf16", "--json", str(out)])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return json.loads(out.read_text()), res.stdout


def test_ddp_baseline_runs_on_the_same_ranks(both_precisions):
    record, stdout = both_precisions
    assert record["benchmark"] == "train_throughput" and record["device"] == "cpu"
    rows = {r["mode"]: r for r in record["rows"] if r["precision"] == "fp32"}
    assert sorted(rows) == ["ddp", "plain", "ssgd", "ssgd-overlap"] and len(record["rows"]) == 8
    plain, ssgd, ddp = rows["plain"], rows["ssgd"], rows["ddp"]
    assert (ssgd["ranks"], ddp["ranks"], plain["ranks"]) == (2, 2, 1)
    assert (ssgd["backend"], ddp["backend"]) == ("mpi", "gloo")
    # On CPU hadpsgd.run's default (--overlap auto) reduces after backward; ssgd-overlap
    # is --overlap on, in a background thread during backward.
    assert ssgd["overlap"] is False and rows["ssgd-overlap"]["overlap"] is True
    # The plain baseline gets the threads of one rank, not the whole machine.
    assert plain["threads_per_rank"] == ssgd["threads_per_rank"] == ddp["threads_per_rank"]
    for r in record["rows"]:
        assert r["batch_per_rank"] == 4 and r["device"] == "cpu"
        assert math.isfinite(r["sec_per_step"]) and r["sec_per_step"] > 0
        assert r["ratio_vs_plain"] > 0
    assert ssgd["time_vs_ddp"] == pytest.approx(ssgd["sec_per_step"] / ddp["sec_per_step"])
    assert ssgd["time_vs_ddp"] > 0 and ddp["time_vs_ddp"] == 1.0
    assert record["summary"]["tiny/2"]["ssgd_bf16wire_time_vs_ddp"] == ssgd["time_vs_ddp"]
    assert "t/t_ddp" in stdout and "ddp" in stdout  # the table


def test_precision_and_grad_wire_rows(both_precisions):
    record, stdout = both_precisions
    rows = {(r["mode"], r["precision"]): r for r in record["rows"]}
    assert sorted(rows) == sorted((m, p) for m in ("plain", "ssgd", "ssgd-overlap", "ddp")
                                  for p in ("fp32", "bf16"))
    for (mode, _), r in rows.items():
        fp32 = rows[(mode, "fp32")]
        assert r["time_vs_fp32"] == pytest.approx(r["sec_per_step"] / fp32["sec_per_step"])
        if mode.startswith("ssgd"):
            assert r["grad_wire"] == "bf16" and r["grad_wire_bytes_per_step"] > 0
    # DDP is compared at the same precision: hadpsgd bf16 against DDP under bf16 autocast.
    bf16 = rows[("ssgd", "bf16")]
    assert bf16["time_vs_ddp"] == pytest.approx(bf16["sec_per_step"]
                                                / rows[("ddp", "bf16")]["sec_per_step"])
    assert record["summary"]["tiny/2/bf16"]["ssgd_bf16wire_time_vs_fp32"] == bf16["time_vs_fp32"]
    assert "t/t_fp32" in stdout
