"""The exit-code contract of every entry point, as one table (docs/failures.md, *Exit codes*).

0 ok, 1 failed, 2 user error, 3 timed out, 4 diverged, 75 stopped (:mod:`hadpsgd.exit_codes`):
scripts read a command's outcome from its exit code, never from its log. Each row is one
entry point, one code it can return and the cheapest input that produces it. A row runs
``python -m ENTRY`` in a process where the code comes from MPI, a signal or the process's
end; where the command starts no MPI (or fails before it starts), ``main(argv)`` is called in
this process, as ``python -m`` would call it. The processes run a few at a time (the table is
a CI cost: keep it well under a minute); a row that names ``nprocs`` runs under mpirun.

Covered elsewhere, not repeated here: ``hadpsgd.run`` stopped by SIGUSR1 through the
launcher (75, tests/mpi/test_resume.py::test_sigterm_to_the_launcher_stops_gracefully); a
killed rank (exit 137, the shell's 128 + SIGKILL; tests/mpi/test_faults.py, kind=kill);
more than --max-nonfinite non-finite steps (4, tests/mpi/test_nonfinite.py).
"""

from __future__ import annotations

import concurrent.futures as futures
import errno
import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hadpsgd.exit_codes import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_TIMED_OUT,
    EXIT_USER_ERROR,
)
from tests._mpi import ROOT, ranks_python, run_mpi

pytestmark = pytest.mark.mpi

WORKERS = 3  # processes at once: mostly imports, so a few overlap well even on 2 cores
PROCESS_TIMEOUT_S = 120.0
RUN = ("--train", "{train}", "--heldout", "{heldout}", "--preset", "tiny", "--batch-size", "4",
       "--no-progress", "--out-dir", "{out}")
FORWARD = ("--model", "{model}", "--features", "{heldout}", "--no-progress")


def _fail_writes(mp: pytest.MonkeyPatch) -> None:
    from hadpsgd.data.writer import FeatureWriter

    def commit(*_: Any, **__: Any) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    mp.setattr(FeatureWriter, "commit", commit)


@dataclass(frozen=True)
class Row:
    """One entry point, one exit code, and the cheapest input that makes it return it."""

    entry: str
    code: int
    case: str
    argv: tuple[str, ...]
    how: str = "process"  # "process": python -m ENTRY in a process; "call": main(argv) here
    nprocs: int = 0  # > 0: under mpirun with this many ranks
    env: dict[str, str] = field(default_factory=dict)
    says: str = ""  # a phrase the output must hold
    patch: Callable[[pytest.MonkeyPatch], None] | None = None  # "call" rows: a fault to inject
    off: str = ""  # why the entry point is off the contract (the row is a strict xfail)

    @property
    def id(self) -> str:
        return f"{self.entry.removeprefix('hadpsgd.')}-{self.code}-{self.case}"


TABLE = [
    # python -m hadpsgd.run: every code of hadpsgd.exit_codes.
    Row("hadpsgd.run", EXIT_OK, "tiny", (*RUN, "--max-steps", "2"), says="[hadpsgd] done in"),
    Row("hadpsgd.run", EXIT_USER_ERROR, "bad-flag", ("--no-such-flag",), how="call"),
    Row("hadpsgd.run", EXIT_USER_ERROR, "missing-file",
        (*RUN, "--max-steps", "2", "--train", "{missing}"), says="does not exist"),
    Row("hadpsgd.run", EXIT_FAILED, "fault-raise", (*RUN, "--max-steps", "4"),
        env={"HADPSGD_FAULT": "kind=raise,rank=0,step=1"}, says="injected fault: raise"),
    Row("hadpsgd.run", EXIT_TIMED_OUT, "frozen-rank", (*RUN, "--max-steps", "30"), nprocs=2,
        env={"HADPSGD_FAULT": "kind=hang,rank=1,step=2", "HADPSGD_TIMEOUT": "4"},
        says="HADPSGD_TIMEOUT"),
    Row("hadpsgd.run", EXIT_DIVERGED, "lr-too-high",
        (*RUN, "--max-steps", "60", "--log-every", "5", "--lr", "300", "--max-grad-norm", "1",
         "--max-loss-ratio", "2"), says="the run diverged"),
    Row("hadpsgd.run", EXIT_STOPPED, "signal", (*RUN, "--max-steps", "30"),  # SIGTERM to itself
        env={"HADPSGD_FAULT": "kind=signal,rank=0,step=1"}, says="stop requested"),
    # python -m hadpsgd.forward
    Row("hadpsgd.forward", EXIT_OK, "tiny-overwrite",
        (*FORWARD, "--output", "{old_output}", "--overwrite"), says="wrote 12 utterances"),
    Row("hadpsgd.forward", EXIT_USER_ERROR, "bad-flag", ("--no-such-flag",), how="call"),
    Row("hadpsgd.forward", EXIT_USER_ERROR, "missing-file",
        ("--model", "{missing}", "--features", "{heldout}", "--output", "{out}.h5"),
        says="does not exist"),
    Row("hadpsgd.forward", EXIT_USER_ERROR, "existing-output", (*FORWARD, "--output", "{taken}"),
        says="already exists; pass --overwrite"),
    Row("hadpsgd.forward", EXIT_FAILED, "consumer-fails", (*FORWARD, "--output", "ark:| false"),
        says="Broken pipe"),
    # python -m hadpsgd.decode (1 only on a bug, with its traceback: no input makes it)
    Row("hadpsgd.decode", EXIT_OK, "tiny", ("{loglikes}", "--refs", "none"), how="call"),
    Row("hadpsgd.decode", EXIT_USER_ERROR, "bad-flag", ("{loglikes}", "--beam", "x"),
        how="call"),
    Row("hadpsgd.decode", EXIT_USER_ERROR, "missing-file", ("{missing}",), how="call",
        says="not found"),
    # python -m hadpsgd.data, each subcommand
    Row("hadpsgd.data", EXIT_OK, "info", ("info", "{heldout}"), how="call"),
    Row("hadpsgd.data", EXIT_USER_ERROR, "no-subcommand", (), how="call"),
    Row("hadpsgd.data", EXIT_USER_ERROR, "info-missing-file", ("info", "{missing}"), how="call",
        says="does not exist"),
    Row("hadpsgd.data", EXIT_OK, "mark-silence", ("mark-silence", "{heldout_copy}", "0"),
        how="call"),
    Row("hadpsgd.data", EXIT_USER_ERROR, "mark-silence-missing-file",
        ("mark-silence", "{missing}", "0"), how="call", says="does not exist"),
    # python -m hadpsgd.data.kaldi
    Row("hadpsgd.data.kaldi", EXIT_OK, "tiny",
        ("--feats", "{feats_scp}", "--alignments", "{ali}", "--out", "{out}.h5"), how="call"),
    Row("hadpsgd.data.kaldi", EXIT_USER_ERROR, "bad-flag", ("--feats", "{feats_scp}"),
        how="call"),
    Row("hadpsgd.data.kaldi", EXIT_USER_ERROR, "missing-file",
        ("--feats", "{missing}.scp", "--alignments", "{ali}", "--out", "{out}.h5"), how="call",
        says="missing.h5.scp"),
    Row("hadpsgd.data.kaldi", EXIT_USER_ERROR, "negative-pdf-id",
        ("--feats", "{feats_scp}", "--alignments", "{negative_ali}", "--out", "{out}.h5"),
        how="call", says="utterance 'u1' has pdf-id -1"),
    Row("hadpsgd.data.kaldi", EXIT_FAILED, "write-fails",
        ("--feats", "{feats_scp}", "--alignments", "{ali}", "--out", "{out}.h5"), how="call",
        patch=_fail_writes, says="Input/output error"),
    # python -m hadpsgd.export
    Row("hadpsgd.export", EXIT_OK, "tiny", ("{model}", "--out", "{out}.pt", "--priors", "none"),
        how="call", says="<= tolerance"),
    Row("hadpsgd.export", EXIT_USER_ERROR, "existing-output",
        ("{model}", "--out", "{taken}", "--format", "torchscript"),
        how="call", says="already exists"),
    # python -m hadpsgd.plot
    Row("hadpsgd.plot", EXIT_OK, "run", ("{plot_run}",), how="call"),
    Row("hadpsgd.plot", EXIT_USER_ERROR, "no-metrics", ("{missing}",), how="call"),
    # python -m hadpsgd.launch: its own flags, else the ranks' code passed through (75 from a
    # SIGTERM to it: tests/mpi/test_resume.py::test_sigterm_to_the_launcher_stops_gracefully)
    Row("hadpsgd.launch", EXIT_OK, "dry-run", ("-n", "2", "--dry-run"), how="call"),
    Row("hadpsgd.launch", EXIT_USER_ERROR, "bad-flag", ("-n", "0", "--dry-run"), how="call"),
    Row("hadpsgd.launch", EXIT_USER_ERROR, "ranks-code-passed-through",
        ("-n", "1", "--module", "hadpsgd.data", "--", "info", "{missing}"),
        says="does not exist"),
    # python -m hadpsgd.comm, the machine check: 1 when it finds a problem
    Row("hadpsgd.comm", EXIT_OK, "this-machine", ()),
    Row("hadpsgd.comm", EXIT_FAILED, "a-problem", (), env={"HADPSGD_TIMEOUT": "soon"},
        says="problem: HADPSGD_TIMEOUT"),
    Row("hadpsgd.comm", EXIT_USER_ERROR, "bad-flag", ("--no-such-flag",)),
]


@pytest.fixture(scope="module")
def inputs(tiny_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, str]:
    """Every file a row names, made once: small, and most of them in this process."""
    kaldiio = pytest.importorskip("kaldiio")
    from tests.unit.test_forward import make_run

    tmp = tmp_path_factory.mktemp("contract")
    paths: dict[str, Path] = {"train": tiny_data[0], "heldout": tiny_data[1],
                              "missing": tmp / "missing.h5", "model": tmp / "model",
                              "taken": tmp / "taken.h5", "old_output": tmp / "old.h5",
                              "heldout_copy": tmp / "heldout-copy.h5", "out": tmp / "out"}
    make_run(paths["model"], tiny_data[0], 260, 12)  # a checkpoint, no training
    paths["taken"].write_text("someone's results\n")
    paths["plot_run"] = tmp / "plot-run"
    paths["plot_run"].mkdir()
    (paths["plot_run"] / "metrics.jsonl").write_text("".join(
        f'{{"kind": "train", "step": {k}, "loss": {3.0 - k / 10}}}\n' for k in range(1, 5)))
    paths["old_output"].write_text("last week's results\n")
    shutil.copyfile(tiny_data[1], paths["heldout_copy"])
    rng = np.random.default_rng(0)
    feats = {"u0": rng.standard_normal((6, 5)), "u1": rng.standard_normal((4, 5))}
    paths["feats_scp"], paths["ali"] = tmp / "feats.scp", tmp / "ali.ark"
    kaldiio.save_ark(str(tmp / "feats.ark"), {u: m.astype(np.float32) for u, m in feats.items()},
                     scp=str(paths["feats_scp"]))
    kaldiio.save_ark(str(paths["ali"]), {"u0": np.arange(6, dtype=np.int32) % 3,
                                         "u1": np.zeros(4, np.int32)})
    paths["negative_ali"] = tmp / "negative.ark"
    kaldiio.save_ark(str(paths["negative_ali"]), {"u0": np.zeros(6, np.int32),
                                                  "u1": np.array([0, 1, -1, 0], np.int32)})
    # One utterance of the digit set's 31 classes: "4" between silences, sure posteriors.
    classes = [30] * 3 + [12] * 3 + [13] * 3 + [14] * 3 + [30] * 3
    scores = np.full((len(classes), 31), np.log(0.1 / 30), dtype=np.float32)
    scores[np.arange(len(classes)), classes] = np.log(0.9)
    paths["loglikes"] = tmp / "ll.ark"
    kaldiio.save_ark(str(paths["loglikes"]), {"spk1-000-4": scores})
    return {k: str(v) for k, v in paths.items()}


def _argv(row: Row, inputs: dict[str, str]) -> list[str]:
    where = {**inputs, "out": f"{inputs['out']}-{row.id}"}
    return [arg.format(**where) for arg in row.argv]


def _launch(row: Row, inputs: dict[str, str]) -> tuple[int, str, float]:
    """Run one process row: its exit code, its output and its wall time."""
    start = time.monotonic()
    args = ["-m", row.entry, *_argv(row, inputs)]
    if row.nprocs:
        res = run_mpi(row.nprocs, args, timeout=PROCESS_TIMEOUT_S, env=row.env)
        return res.returncode, res.output, time.monotonic() - start
    env = {k: v for k, v in os.environ.items()  # one process, not a rank of a launcher's job
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1", **ranks_python(env.get("PYTHONPATH", "")))
    env.update(row.env)
    try:
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                             env=env, timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        return -1, f"did not finish in {PROCESS_TIMEOUT_S} s\n{err.stdout}\n{err.stderr}", 0.0
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest, inputs: dict[str, str]
             ) -> Iterator[dict[str, futures.Future[tuple[int, str, float]]]]:
    """The process rows of this session's selection, started at once, a few at a time."""
    rows = [item.callspec.params["row"] for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")
            and "row" in item.callspec.params]
    rows = sorted((r for r in rows if r.how == "process"), key=lambda r: -r.nprocs)
    pool = futures.ThreadPoolExecutor(max_workers=WORKERS)  # the longest (mpirun) rows first
    started = {row.id: pool.submit(_launch, row, inputs) for row in rows}
    yield started
    pool.shutdown(wait=True)


def _call(row: Row, inputs: dict[str, str], capsys: pytest.CaptureFixture[str],
          monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """``main(argv)`` of the module ``python -m ENTRY`` runs, in this process."""
    module = importlib.import_module(row.entry)
    if hasattr(module, "__path__"):  # a package: python -m runs its __main__
        module = importlib.import_module(f"{row.entry}.__main__")
    if row.patch is not None:
        row.patch(monkeypatch)
    try:
        code = module.main(_argv(row, inputs))
    except SystemExit as exc:  # argparse's own exit on a bad flag
        code = exc.code if isinstance(exc.code, int) else EXIT_FAILED
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("row", [
    pytest.param(r, id=r.id, marks=[pytest.mark.xfail(reason=r.off, strict=True)] if r.off else [])
    for r in TABLE])
def test_exit_code(row: Row, inputs: dict[str, str],
                   launched: dict[str, futures.Future[tuple[int, str, float]]],
                   capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if row.entry == "hadpsgd.decode":
        for name in ("kaldifst", "kaldi_decoder", "kaldialign"):
            pytest.importorskip(name)
    if row.how == "call":
        code, output = _call(row, inputs, capsys, monkeypatch)
    else:
        code, output, took = launched[row.id].result()
        print(f"{row.id}: exit {code} in {took:.1f} s")
    assert code == row.code, f"python -m {row.entry} {' '.join(_argv(row, inputs))}: exit " \
                             f"{code}, the contract says {row.code}\n{output[-4000:]}"
    assert row.says in output, output[-4000:]
    if row.code == EXIT_USER_ERROR:  # one line naming the problem, no traceback
        assert "Traceback" not in output, output[-4000:]


def test_every_entry_point_has_its_codes() -> None:
    """The table covers each entry point's 0 and 2, and hadpsgd.run's every code."""
    entries = {r.entry for r in TABLE}
    assert entries == {"hadpsgd.run", "hadpsgd.forward", "hadpsgd.decode", "hadpsgd.data",
                       "hadpsgd.data.kaldi", "hadpsgd.export", "hadpsgd.plot",
                       "hadpsgd.launch", "hadpsgd.comm"}
    for entry in entries:
        assert {EXIT_OK, EXIT_USER_ERROR} <= {r.code for r in TABLE if r.entry == entry}, entry
    assert {r.code for r in TABLE if r.entry == "hadpsgd.run"} == {
        EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR, EXIT_TIMED_OUT, EXIT_DIVERGED, EXIT_STOPPED}
