"""Helpers of the communication and throughput benchmarks (no MPI: the drivers never import it)."""

import math
from pathlib import Path

import pytest
import torch

from benchmarks.comm.cli import inside_mpi, parse_args, worker_argv
from benchmarks.comm.measure import Timing, _device_keys
from benchmarks.comm.report import (
    MIB,
    TABLE_HEADER,
    bandwidths,
    bus_factor,
    compare_backends,
    format_row,
    format_size,
    intra_view_names,
    parse_size,
    plan_iters,
    size_sweep,
    summarize,
    table_header,
)
from benchmarks.training import throughput as tt


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


# ---------------------------------------------------------------------------- GPU mode of comm
def test_device_option_defaults_to_cpu_and_reaches_the_ranks():
    assert parse_args([]).device == "cpu"
    assert "--device" not in worker_argv(parse_args([]), Path("o.json"))  # CPU argv unchanged
    a = parse_args(["--device", "cuda", "--op", "allreduce"])
    b = parse_args(worker_argv(a, Path("o.json")))
    assert a.device == b.device == "cuda"
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_stops_before_launching(capsys):
    from benchmarks.comm.cli import main

    assert main(["--device", "cuda", "-n", "2"]) == 2
    assert tt.main(["--device", "cuda", "--presets", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("CUDA is not available") == 2 and "--device cpu" in err


def test_table_header_names_the_baselines_of_the_device():
    assert table_header() == table_header("cpu") == TABLE_HEADER
    assert "mpi4py" in TABLE_HEADER and "gloo" in TABLE_HEADER
    cuda = table_header("cuda")
    assert "mpi4py+cp" in cuda and "mpi4py-dev" in cuda and "gloo" not in cuda
    # Same columns, so a CPU and a GPU table line up.
    assert [len(line) for line in cuda.splitlines()] == \
        [len(line) for line in TABLE_HEADER.splitlines()]


def _cuda_row(name, size, time_us, staged_us, device_us=None):
    t = Timing(time_us * 1e-6, 10)
    row = _row(name, size, time_us, staged_us)
    row.update(_device_keys(size, row["op"], 2, t,
                            Timing(device_us * 1e-6, 10) if device_us else None,
                            {"intra": "nccl", "inter": "mpi via host"}))
    return row


def test_device_keys_hold_the_direct_baseline():
    row = _cuda_row("allreduce/flat", MIB, 100.0, 300.0, device_us=50.0)
    assert row["ratio"] == pytest.approx(3.0)                # through host copies
    assert row["device_ratio"] == pytest.approx(0.5)         # on the device buffers
    assert row["mpi4py_device_time_us"] == pytest.approx(50.0)
    assert row["mpi4py_device_busbw_gbps"] == pytest.approx(bandwidths(MIB, 50e-6,
                                                                       "allreduce", 2)[1])
    assert row["route"] == {"intra": "nccl", "inter": "mpi via host"}
    staged_only = _cuda_row("allreduce/flat", MIB, 100.0, 300.0)
    assert staged_only["device_ratio"] is None and staged_only["mpi4py_device_iters"] is None


def test_format_row_on_cuda_shows_the_device_baseline():
    cells = format_row(_cuda_row("allreduce/flat", 1024, 10.0, 30.0, 5.0), "cuda").split()
    assert cells[-4:] == ["30.0", "3.00", "5.0", "0.50"]
    cells = format_row(_cuda_row("broadcast", 1024, 10.0, 30.0), "cuda").split()
    assert cells[-2:] == ["-", "-"]


def test_summary_adds_device_ratios_only_on_cuda():
    cpu_rows = [_row("allreduce/flat", MIB, 100.0, 50.0)]
    cpu = summarize(cpu_rows, "x")
    assert "device" not in cpu and "allreduce_flat_device_ratio_ge_1MiB" not in cpu
    assert "device_busbw_ratio_ge_1MiB" not in cpu["per_op"]["allreduce/flat"]
    rows = [_cuda_row("allreduce/flat", MIB, 100.0, 300.0, 50.0),
            _cuda_row("allreduce/flat", 2 * MIB, 100.0, 100.0, 150.0),
            _cuda_row("exchange", MIB, 10.0, 20.0)]
    s = summarize(rows, "x", "cuda")
    assert s["device"] == "cuda"
    assert s["allreduce_flat_ratio_ge_1MiB"] == pytest.approx((3.0 + 1.0) / 2)
    assert s["allreduce_flat_device_ratio_ge_1MiB"] == pytest.approx((0.5 + 1.5) / 2)
    assert s["per_op"]["allreduce/flat"]["device_busbw_ratio_ge_1MiB"] == pytest.approx(1.0)
    assert "device_busbw_ratio_ge_1MiB" not in s["per_op"]["exchange"]  # not CUDA-aware there


@pytest.mark.parametrize("device, own, requested, names, skipped", [
    ("cpu", "mpi", ["mpi", "gloo"], ["mpi", "gloo"], False),
    ("cpu", "mpi", ["gloo"], ["gloo"], False),
    ("cuda", "nccl", ["mpi", "gloo"], ["nccl", "mpi"], True),     # NCCL vs MPI via host
    ("cuda", "mpi", ["mpi", "gloo"], ["mpi"], True),              # NCCL off: staged MPI only
    ("cuda", "nccl", ["gloo"], ["nccl"], True),
    ("cuda", "gloo", ["mpi", "gloo"], ["gloo", "mpi"], False),    # asked for by the user
])
def test_intra_views_per_device(device, own, requested, names, skipped):
    got, notes = intra_view_names(device, own, requested)
    assert got == names
    assert bool(notes) == skipped and all("gloo" in n for n in notes)


# ---------------------------------------------------------------------------- throughput driver
def test_threads_per_rank_shares_the_cores():
    assert tt.threads_per_rank(2, 1) == 2
    assert tt.threads_per_rank(2, 2) == 1
    assert tt.threads_per_rank(2, 4) == 1      # never below one
    assert tt.threads_per_rank(16, 3) == 5
    assert tt.threads_per_rank(8, 0) == 8


def test_throughput_arguments():
    a = tt.parse_args([])
    assert (a.device, a.ranks, a.presets, a.steps) == ("cpu", [1, 2], ["small", "swb"], 5)
    a = tt.parse_args(["--device", "cuda", "--ranks", "2", "2", "1", "--presets", "tiny"])
    assert a.device == "cuda" and a.ranks == [2, 1]
    for bad in (["--device", "tpu"], ["--ranks", "0"], ["--steps", "0"], ["--batch", "-1"],
                ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            tt.parse_args(bad)


def _tt_row(mode, ranks, threads, sec, preset="small", batch=32):
    return {"mode": mode, "preset": preset, "ranks": ranks, "device": "cpu",
            "backend": {"plain": None, "ssgd": "mpi", "ddp": "gloo"}[mode],
            "threads_per_rank": threads, "batch_per_rank": batch, "sec_per_step": sec,
            "frames_per_s": batch * 21 * ranks / sec}


def test_ratios_pair_each_run_with_its_own_baselines():
    rows = [_tt_row("plain", 1, 2, 1.0), _tt_row("ssgd", 1, 2, 1.0), _tt_row("ddp", 1, 2, 0.5),
            _tt_row("plain", 1, 1, 2.0), _tt_row("ssgd", 2, 1, 3.0), _tt_row("ddp", 2, 1, 2.0),
            _tt_row("ssgd", 2, 1, 1.0, preset="swb")]           # no DDP row for swb
    tt.add_ratios(rows)
    plain2, ssgd1, ddp1, plain1, ssgd2, ddp2, swb = rows
    assert plain2["ratio_vs_plain"] == plain1["ratio_vs_plain"] == 1.0
    assert plain1["time_vs_ddp"] is None
    assert ssgd1["ratio_vs_plain"] == pytest.approx(1.0)        # against the 2-thread plain
    assert ssgd2["ratio_vs_plain"] == pytest.approx(2 * 2.0 / 3.0)  # the 1-thread plain
    assert ddp2["ratio_vs_plain"] == pytest.approx(2.0)
    assert ssgd1["time_vs_ddp"] == pytest.approx(2.0)
    assert ssgd2["time_vs_ddp"] == pytest.approx(1.5)
    assert ddp1["time_vs_ddp"] == ddp2["time_vs_ddp"] == 1.0
    assert swb["time_vs_ddp"] is None and swb["ratio_vs_plain"] is None
    s = tt.summarize(rows)
    assert s["small/2"] == {"ssgd_time_vs_ddp": pytest.approx(1.5),
                            "ssgd_vs_plain": pytest.approx(4 / 3), "ddp_vs_plain": 2.0,
                            "ssgd_efficiency": pytest.approx(2 / 3),
                            "ddp_efficiency": pytest.approx(1.0)}
    assert s["swb/2"]["ssgd_time_vs_ddp"] is None


def test_throughput_table_rows():
    rows = [_tt_row("plain", 1, 1, 0.25), _tt_row("ssgd", 2, 1, 0.5), _tt_row("ddp", 2, 1, 0.4)]
    tt.add_ratios(rows)
    header = tt.TABLE_HEADER.split()
    assert header[-4:] == ["plain", "t/t_ddp", "t/t_fp32", "MiB/step"]
    assert "backend" in header and "prec" in header and "wire" in header
    plain, ssgd, _ = (tt.format_row(r).split() for r in rows)
    # preset, mode, precision, wire, ranks, device, backend, ...
    assert plain[:6] == ["small", "plain", "fp32", "-", "1", "cpu"] and plain[6] == "-"
    # vs plain, t/t_ddp, t/t_fp32, MiB/step (none measured by these rows)
    assert plain[-4:] == ["1.00", "-", "1.00", "-"]
    assert ssgd[3] == "fp32" and ssgd[6] == "mpi" and ssgd[-4:-2] == ["1.00", "1.25"]
