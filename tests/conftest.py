"""Shared fixtures: a small synthetic dataset (the mpirun helpers are in ``tests/_mpi.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

SLOW_FILES: tuple[str, ...] = (
    "tests/mpi/test_comm_layer.py", "tests/mpi/test_elastic.py", "tests/mpi/test_faults.py",
    "tests/mpi/test_adpsgd.py", "tests/mpi/test_many_ranks.py", "tests/mpi/test_resume.py",
    "tests/mpi/test_run_cli.py", "tests/mpi/test_exit_contract.py",
    "tests/mpi/test_startup_deadline.py", "tests/mpi/test_precision.py",
    "tests/mpi/test_two_hosts.py", "tests/mpi/test_nonfinite.py", "tests/mpi/test_sites.py",
    "tests/mpi/test_ssgd.py", "tests/mpi/test_bad_input.py", "tests/mpi/test_frozen.py",
    "tests/mpi/test_script_end.py", "tests/mpi/test_api_errors.py",
    "tests/mpi/test_compressed.py", "tests/mpi/test_bmuf_cli.py",
    "tests/mpi/test_checkpoint_faults.py", "tests/mpi/test_overlap.py",
    "tests/mpi/test_bmuf_stream.py", "tests/mpi/test_soak_findings.py", "tests/mpi/test_api.py",
    "tests/lab/test_bench_link.py", "tests/lab/test_bench_comm_mpi.py",
    "tests/lab/test_bench_pipeline_progress.py", "tests/lab/test_bench_throughput.py",
)
"""The slowest test files, slowest first (the "time by test file" table of a CI run).

Collected first, so that under ``pytest -n 2 --dist loadfile --no-loadscope-reorder``
(scripts/test.sh) the two processes start with the long files and end on the many short
ones, rather than one process finishing a long file alone at the end (xdist's own order
is by the number of tests a file has, which put one-test files of 40 s last). Only the
order: a file missing here, or a stale entry, changes nothing else.
"""

_STARTED = time.monotonic()
WORKER_LAST: dict[str, float] = {}
"""Seconds from the session's start to each pytest process's last report (``-n``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first (:data:`SLOW_FILES`), every other test in its collected order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small synthetic train/held-out pair (fast to train on with the tiny preset)."""
    from hadpsgd.data.synth import SynthSpec, generate

    out = tmp_path_factory.mktemp("data")
    spec = SynthSpec(feat_dim=260, num_classes=12, train_utts=60, heldout_utts=12,
                     min_len=60, max_len=120, seed=3)
    return generate(out, spec)


FILE_SECONDS: dict[str, float] = {}
"""Seconds of setup, call and teardown, summed by test file (the terminal summary's table)."""


REPORTED_LAUNCHES: list[dict] = []
"""The launches the test reports carried (``pytest -n``'s workers send them in their reports)."""

_SENT = [0]
"""How many of this process's ``LAUNCHES`` a report has carried already."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Carry the launches made since the last report in this one (a worker's reach the
    controller that way under ``pytest -n``; without it the same path is taken)."""
    from tests._mpi import LAUNCHES

    outcome = yield
    report = outcome.get_result()
    new, _SENT[0] = LAUNCHES[_SENT[0]:], len(LAUNCHES)
    if new:
        report.user_properties.append(("launches", [dict(launch) for launch in new]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's time to its test file's total, and its launches to the table."""
    name = report.nodeid.split("::")[0]
    FILE_SECONDS[name] = FILE_SECONDS.get(name, 0.0) + report.duration
    worker = getattr(getattr(report, "node", None), "gateway", None)
    WORKER_LAST[getattr(worker, "id", "main")] = time.monotonic() - _STARTED
    for key, value in report.user_properties:
        if key == "launches":
            REPORTED_LAUNCHES.extend(value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The time of the run by test file, and its mpirun launches: ranks started and seconds.

    Each rank of each launch imports torch (~1.3 s of CPU on the 2-core CI machine; the
    ~1.2 s of torch._dynamo that every optimizer imports is a stand-in's in tests:
    ``tests/_site/sitecustomize.py``), so the multi-rank suite's time follows the ranks it
    starts more than the tests it counts: this table says where CI's minutes go.
    """
    if FILE_SECONDS:  # every test, launches or not: where the suite's minutes go
        terminalreporter.section("time by test file (slowest 25)")
        for name, secs in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{secs:8.1f} s  {name}")
        terminalreporter.write_line(f"{sum(FILE_SECONDS.values()):8.1f} s  in all "
                                    f"({len(FILE_SECONDS)} files)")
    if len(WORKER_LAST) > 1:  # how evenly the processes shared the files: the idle tail
        ends = ", ".join(f"{w} {t:.0f} s" for w, t in sorted(WORKER_LAST.items()))
        terminalreporter.write_line(f"last report of each process: {ends}")
    if not REPORTED_LAUNCHES:
        return
    files: dict[str, list[float]] = {}
    for launch in REPORTED_LAUNCHES:
        row = files.setdefault(launch["test"].split("::")[0] or "?", [0, 0, 0.0])
        row[0] += 1
        row[1] += launch["nprocs"]
        row[2] += launch["seconds"]
    write = terminalreporter.write_line
    terminalreporter.section("mpirun launches by test file (slowest 20)")
    for name, (n, ranks, secs) in sorted(files.items(), key=lambda kv: -kv[1][2])[:20]:
        write(f"{secs:8.1f} s {n:4d} launches {ranks:5d} ranks  {name}")
    total = [sum(row[i] for row in files.values()) for i in range(3)]
    write(f"{total[2]:8.1f} s {total[0]:4d} launches {total[1]:5d} ranks  in all")
