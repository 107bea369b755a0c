"""Helpers of the communication microbenchmark (no MPI: the driver part never imports it)."""

import math
from pathlib import Path

import pytest

from benchmarks.comm import (
    MIB,
    bandwidths,
    bus_factor,
    compare_backends,
    format_row,
    format_size,
    inside_mpi,
    parse_args,
    parse_size,
    plan_iters,
    size_sweep,
    summarize,
    worker_argv,
)


@pytest.mark.parametrize("text, expected", [
    ("8", 8), ("4K", 4096), ("4k", 4096), ("4KiB", 4096), ("4KB", 4096), ("256M", 256 * MIB),
    ("1G", 2**30), ("1.5K", 1536), (" 16 B ", 16), ("0", 0), (12, 12),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1.3", "-4", "4X", "K", "4iB", -1])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size():
    assert [format_size(s) for s in (8, 1024, 1536, 256 * MIB, 2**30)] == \
        ["8 B", "1 KiB", "1536 B", "256 MiB", "1 GiB"]


def test_default_sweep_is_8B_to_256MiB_by_powers_of_two():
    sizes = size_sweep(8, 256 * MIB, 2)
    assert sizes[0] == 8 and sizes[-1] == 256 * MIB and len(sizes) == 26
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))
    assert parse_args([]).sizes == sizes


def test_sweep_rounds_to_whole_float32_elements():
    assert size_sweep(6, 100, 2) == [4, 12, 24, 48, 96]
    assert size_sweep(4, 4096, 4) == [4, 16, 64, 256, 1024, 4096]
    assert size_sweep(5, 7, 2) == [4]
    for bad in ((2, 16, 2), (16, 8, 2), (8, 64, 1)):
        with pytest.raises(ValueError):
            size_sweep(*bad)


def test_bus_factor_follows_nccl_tests():
    assert bus_factor("allreduce", 4) == pytest.approx(1.5)
    assert bus_factor("allreduce", 2) == pytest.approx(1.0)
    assert bus_factor("allreduce", 1) == 0.0
    assert bus_factor("intra", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("broadcast", 64) == 1.0
    assert bus_factor("exchange", 2) == 1.0
    with pytest.raises(ValueError):
        bus_factor("alltoall", 4)
    with pytest.raises(ValueError):
        bus_factor("allreduce", 0)


def test_bandwidths():
    algbw, busbw = bandwidths(2 * 10**9, 2.0, "allreduce", 4)
    assert algbw == pytest.approx(1.0) and busbw == pytest.approx(1.5)
    assert bandwidths(10**9, 0.5, "broadcast", 8) == pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError):
        bandwidths(8, 0.0, "broadcast", 2)


def test_plan_iters_fits_the_budget_within_bounds():
    assert plan_iters(1e-5, 200, 3, 0.25) == 200      # fast op: capped by --iters
    assert plan_iters(0.01, 200, 3, 0.25) == 25       # budget / time
    assert plan_iters(2.0, 200, 3, 0.25) == 3         # slow op: never below --min-iters
    assert plan_iters(2.0, 2, 3, 0.25) == 2           # ... unless --iters is smaller
    assert plan_iters(0.0, 50, 3, 0.25) == 50


def test_inside_mpi_detection():
    assert not inside_mpi({})
    assert inside_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
    assert inside_mpi({"PMIX_RANK": "0"})
    assert inside_mpi({"PMI_RANK": "3"})


def test_ops_parsing():
    assert parse_args([]).op == ["allreduce", "broadcast", "exchange"]
    assert parse_args(["--op", "all"]).op == ["allreduce", "broadcast", "exchange", "intra"]
    assert parse_args(["--op", "intra,allreduce", "allreduce"]).op == ["intra", "allreduce"]
    with pytest.raises(SystemExit):
        parse_args(["--op", "alltoall"])
    with pytest.raises(SystemExit):
        parse_args(["--max-bytes", "1Q"])


def test_worker_argv_reproduces_the_options():
    a = parse_args(["-n", "8", "--ranks-per-node", "4", "--op", "allreduce", "intra",
                    "--max-bytes", "1M", "--iters", "7", "--bucket-mb", "16", "--no-gloo",
                    "--hier-algo", "leader", "--intra-backend", "gloo"])
    argv = worker_argv(a, Path("out.json"))
    assert argv[0] == "--no-launch" and "-n" not in argv
    b = parse_args(argv)
    for key in ("op", "sizes", "iters", "warmup", "min_iters", "max_time", "bucket_mb",
                "no_gloo", "hier_algo", "intra_backend", "intra_backends"):
        assert getattr(a, key) == getattr(b, key), key
    assert b.no_launch and b.json == Path("out.json")


def _row(name, size, time_us, base_us, backend=None, gloo_us=None):
    op, _, path = name.partition("/")
    row = {"op": op, "path": path or None, "backend": backend, "name": name,
           "size_bytes": size, "count": size // 4, "time_us": time_us, "algbw_gbps": 1.0,
           "busbw_gbps": 1.0, "mpi4py_time_us": base_us, "ratio": base_us / time_us,
           "gloo_time_us": gloo_us, "gloo_ratio": gloo_us / time_us if gloo_us else None}
    if backend:
        row["name"] = f"{name}[{backend}]" if op == "allreduce" else f"{op}/{backend}"
    return row


def test_summary_ratios():
    rows = [_row("allreduce/flat", 512, 20.0, 10.0, gloo_us=40.0),
            _row("allreduce/flat", 1024, 30.0, 10.0, gloo_us=60.0),
            _row("allreduce/flat", 4096, 1.0, 1.0, gloo_us=1.0),   # in neither class
            _row("allreduce/flat", MIB, 100.0, 50.0, gloo_us=200.0),
            _row("allreduce/flat", 2 * MIB, 100.0, 150.0, gloo_us=300.0),
            _row("broadcast", MIB, 10.0, 10.0)]
    s = summarize(rows, "layout")
    assert s["layout"] == "layout"
    assert s["allreduce_flat_ratio_ge_1MiB"] == pytest.approx((0.5 + 1.5) / 2)
    assert s["allreduce_flat_latency_ratio_le_1KiB"] == pytest.approx((2.0 + 3.0) / 2)
    assert s["allreduce_flat_gloo_ratio_ge_1MiB"] == pytest.approx((2.0 + 3.0) / 2)
    assert s["allreduce_hier_ratio_ge_1MiB"] is None
    assert s["per_op"]["broadcast"]["busbw_ratio_ge_1MiB"] == pytest.approx(1.0)
    assert "intra_gloo_vs_mpi" not in s


def test_backend_comparison():
    rows = [_row("intra", 8, 10.0, 5.0, "mpi"), _row("intra", 8, 30.0, 5.0, "gloo"),
            _row("intra", MIB, 100.0, 90.0, "mpi"), _row("intra", MIB, 50.0, 90.0, "gloo"),
            _row("allreduce/hier", 8, 10.0, 5.0, "mpi"),
            _row("allreduce/hier", 8, 20.0, 5.0, "gloo")]
    cmp = compare_backends(rows)
    assert cmp["intra"]["gloo_over_mpi_time_le_1KiB"] == pytest.approx(3.0)
    assert cmp["intra"]["gloo_over_mpi_time_ge_1MiB"] == pytest.approx(0.5)
    assert (cmp["intra"]["mpi_faster_sizes"], cmp["intra"]["gloo_faster_sizes"]) == (1, 1)
    assert cmp["allreduce/hier"]["gloo_over_mpi_time_le_1KiB"] == pytest.approx(2.0)
    assert summarize(rows, "x")["intra_gloo_vs_mpi"] == cmp


def test_format_row_marks_missing_baselines():
    line = format_row(_row("broadcast", 1024, 12.5, 10.0))
    assert "broadcast" in line and "12.5" in line and line.split()[-2:] == ["-", "-"]
    assert not math.isnan(float(line.split()[-3]))
