"""``python -m hadpsgd.run`` refuses every bad input before training, naming file and fix.

The single-rank refusals share one launch: ``tests/workers/refusals.py`` runs the command's
``main`` once per case in one process, each case's output captured as its own process would
print it (the variants of each case are covered without MPI in
tests/unit/test_data_validate.py). The multi-rank cases launch each: they put the damage
where only rank 1's share of the scan sees it, so the job must still end, promptly and with
the error, on every rank. The last cases edit a stamped file in place
(the stamp kept): labels are refused when the file opens, a frame outside the stamp's sample
when training reads it, every one a user's error (exit 2, one line, the file and the fix).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from hadpsgd.data import ChunkDataset, write_features
from hadpsgd.data.validate_stamp import sample_frames
from tests._commands import run_command
from tests._mpi import MPIResult, assert_ok, run_mpi, run_worker

pytestmark = pytest.mark.mpi

BATCH = 4
# What the entry point prints only once everything is built, right before training.
BANNER = "[hadpsgd] ssgd on"


def argv(train: Path, heldout: Path, out: Path, *extra: str) -> list[str]:
    """``python -m hadpsgd.run``'s arguments for a one-epoch tiny run."""
    return ["--train", str(train), "--heldout", str(heldout), "--preset", "tiny", "--epochs",
            "1", "--batch-size", str(BATCH), "--no-progress", "--out-dir", str(out), *extra]


def launch(nprocs: int, train: Path, heldout: Path, out: Path, *extra: str,
           ends_job: bool = False) -> MPIResult:
    """The run on a warm world (tests/_commands.py), or launched where an error mid-run ends
    the job by MPI's abort (``ends_job``: the warm world would lose what it printed)."""
    run = run_mpi if ends_job else run_command
    return run(nprocs, ["-m", "hadpsgd.run", *argv(train, heldout, out, *extra)], timeout=120)


# ------------------------------------------------------------------ one rank, one launch
Case = Callable[[tuple[Path, Path], Path], tuple[Path, Path]]
REFUSALS: dict[str, tuple[Case, tuple[str, ...]]] = {}
"""A single-rank case's name -> its builder and the phrases its error line must hold. Given
the good data and a folder of its own, the builder damages a copy and returns the run's
(train, held-out) files; ``{train}`` and ``{heldout}`` in a phrase are those paths."""


def refusal(name: str, *phrases: str) -> Callable[[Case], Case]:
    """Register a single-rank case's builder under ``name`` with its error's ``phrases``."""
    def register(build: Case) -> Case:
        REFUSALS[name] = (build, phrases)
        return build
    return register


@pytest.fixture(scope="module")
def refused(tiny_data: tuple[Path, Path],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[MPIResult, Path, tuple]]:
    """Every single-rank case built, then refused in one launch: name -> (result, out-dir,
    the run's (train, held-out) files). The result is the case's own: its exit code and
    what it printed.
    """
    cases, outs, files = {}, {}, {}
    for name, (build, _) in REFUSALS.items():
        folder = tmp_path_factory.mktemp(name)
        outs[name], files[name] = folder / "o", build(tiny_data, folder)
        cases[name] = argv(*files[name], outs[name])
    res = run_worker(1, "refusals", env={"REFUSAL_CASES": json.dumps(cases)}, timeout=300)
    assert_ok(res)
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULTS "))
    got = json.loads(line.removeprefix("RESULTS "))
    return {name: (MPIResult(r["code"], r["stdout"], r["stderr"]), outs[name], files[name])
            for name, r in got.items()}


def assert_refused(res: MPIResult, nprocs: int, out: Path, *phrases: str) -> str:
    """The job failed as a user error, before training; returns the error line."""
    if nprocs == 1:
        assert res.returncode == 2, res.output[-4000:]
    else:
        assert res.returncode != 0, res.output[-4000:]
    prefix = "hadpsgd: error: " if nprocs == 1 else ": error: "
    lines = [ln for ln in res.stderr.splitlines() if prefix in ln]
    assert lines, res.output[-4000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    assert BANNER not in res.stdout
    # The output directory is created after the data checks: it must not exist at all.
    assert not out.exists()
    return lines[0]


def copy_of(src: Path, tmp_path: Path, name: str, keep_stamp: bool = False) -> Path:
    """A copy to damage; without the writer's validation stamp unless ``keep_stamp``: the
    damage stands for a file from another writer, which is always scanned."""
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    if not keep_stamp:
        with h5py.File(dst, "r+") as f:
            del f.attrs["validated"]
    return dst


@refusal("truncated", "cut.h5", "truncated", "copy it again")
def truncated(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    bad = tmp_path / "cut.h5"
    data = tiny_data[0].read_bytes()
    bad.write_bytes(data[:len(data) // 2])
    return bad, tiny_data[1]


def test_damaged_frames_seen_by_one_rank_end_every_rank(tiny_data, tmp_path):
    bad = copy_of(tiny_data[0], tmp_path, "damaged.h5")
    with h5py.File(bad, "r+") as f:
        feats = f["feats"][()]
        del f["feats"]
        f.create_dataset("feats", data=feats, chunks=(256, feats.shape[1]), compression="gzip")
        last = f["feats"].id.get_num_chunks() - 1
        info = f["feats"].id.get_chunk_info(last)  # the file's tail: rank 1's share
    with open(bad, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(b"\xff" * info.size)
    res = launch(2, bad, tiny_data[1], tmp_path / "o")
    assert_refused(res, 2, tmp_path / "o", "damaged.h5", "cannot read frames", "copy it again")


@refusal("missing-dataset", "nolabels.h5", "missing dataset 'labels'",
         "rewrite it with hadpsgd.data.write_features")
def missing_dataset(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    bad = copy_of(tiny_data[1], tmp_path, "nolabels.h5")
    with h5py.File(bad, "r+") as f:
        del f["labels"]
    return tiny_data[0], bad


@refusal("feature-dim", "dim13.h5", "feature-dim mismatch", "260 are expected",
         "use matching data")
def feature_dim(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    bad = tmp_path / "dim13.h5"
    rng = np.random.default_rng(0)
    write_features(bad, [rng.standard_normal((50, 13))], [np.zeros(50, int)], ["u"], 12)
    return tiny_data[0], bad


@pytest.mark.parametrize("stamped", [False, True], ids=["no-stamp", "stamp+verify-data"])
def test_nan_frame_seen_by_one_rank_ends_every_rank(tiny_data, tmp_path, stamped):
    # A stamped file is trusted unless --verify-data: with it, the damage done after writing
    # is found like in a file without a stamp.
    bad = copy_of(tiny_data[0], tmp_path, "nan.h5", keep_stamp=stamped)
    with h5py.File(bad, "r+") as f:
        frame = f["feats"].shape[0] - 5  # the last utterance: only rank 1 scans it
        f["feats"][frame, 7] = np.nan
        utt_id = f["utt_ids"].asstr()[-1]
    res = launch(2, bad, tiny_data[1], tmp_path / "o", *(["--verify-data"] if stamped else []))
    assert_refused(res, 2, tmp_path / "o", "nan.h5", f"NaN or Inf) at frame {frame}",
                   repr(utt_id), "rewrite the file")


@refusal("label-range", "label.h5", "at frame 100", "outside [0, num_classes",
         "num_classes attribute is too small")
def label_range(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    bad = copy_of(tiny_data[0], tmp_path, "label.h5")
    with h5py.File(bad, "r+") as f:
        f["labels"][100] = f.attrs["num_classes"]
    return bad, tiny_data[1]


@refusal("zero-bytes", "empty.h5", "empty (0 bytes)", "regenerate")
def zero_bytes(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    bad = tmp_path / "empty.h5"
    bad.touch()
    return bad, tiny_data[1]


def test_fewer_chunks_than_one_global_batch(tiny_data, tmp_path):
    chunks = len(ChunkDataset(tiny_data[0], 21))
    per_rank = chunks // 2 + 1  # two ranks need more than the file holds
    res = launch(2, tiny_data[0], tiny_data[1], tmp_path / "o", "--batch-size", str(per_rank))
    assert_refused(res, 2, tmp_path / "o", tiny_data[0].name, f"{chunks} chunks of 21 frames",
                   f"global batch of {2 * per_rank}", "zero steps", "smaller --batch-size")


@refusal("offsets-ids", "ids.h5", "'utt_ids' has shape",
         "rewrite it with hadpsgd.data.write_features")
def offsets_ids(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    bad = copy_of(tiny_data[0], tmp_path, "ids.h5")
    with h5py.File(bad, "r+") as f:
        ids = f["utt_ids"][:-1]
        del f["utt_ids"]
        f.create_dataset("utt_ids", data=ids)
    return bad, tiny_data[1]


@refusal("directory", "--train", "features", "is a directory", "pass the .h5 file inside it")
def directory(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "features"
    folder.mkdir()
    return folder, tiny_data[1]


@refusal("no-such-path", "--heldout", "nope.h5", "does not exist", "check the path")
def no_such_path(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    return tiny_data[0], tmp_path / "nope.h5"


# Root reads files whatever their mode: the case exists only for other users.
if os.geteuid() != 0:
    @refusal("unreadable", "secret.h5", "permission denied", "chmod a+r")
    def unreadable(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
        bad = copy_of(tiny_data[0], tmp_path, "secret.h5")
        bad.chmod(0)
        return bad, tiny_data[1]


# ------------------------------------------------------------------ edited after the stamp
VALIDATE = "python -m hadpsgd.data validate"


EDITS = {"train": 9999, "heldout": -1}
"""The split whose stamped file gets an edited label, and the label written."""


def edited_labels(split: str) -> Case:
    """A builder: ``split``'s file, stamped, with label 30 set to ``EDITS[split]``."""
    def build(tiny_data: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
        src = tiny_data[0] if split == "train" else tiny_data[1]
        bad = copy_of(src, tmp_path, f"{split}-edited.h5", keep_stamp=True)
        with h5py.File(bad, "r+") as f:
            f["labels"][30] = EDITS[split]
        return (bad, tiny_data[1]) if split == "train" else (tiny_data[0], bad)
    return build


for _split in EDITS:
    # Before: 9999 trained into an IndexError after priors.json; -1 an unclear exit 2 after
    # config.json; in the held-out file, the same at the first evaluation. The other pairs
    # take the same path (tests/unit/test_data_validate.py has each). The run directory
    # must not exist: no config.json, no priors.json.
    refusal(f"edited-{_split}", f"{{{_split}}}", f"label {EDITS[_split]} at frame 30",
            "changed after it was validated", f"{VALIDATE} {{{_split}}}")(edited_labels(_split))


@pytest.mark.parametrize("split", ["heldout", "train"])
def test_nan_frame_in_a_stamped_file_read_mid_run(tiny_data, tmp_path, split):
    """A frame the stamp's sample misses passes the open; reading it ends the run as exit 2.

    Held-out: the last utterance, read by one rank of two at the first evaluation. Training:
    every frame outside the sample (the first batch meets one), read in a loader worker,
    whose error must arrive as itself, not as a worker's traceback.
    """
    bad = copy_of(tiny_data[0 if split == "train" else 1], tmp_path, "nan.h5",
                  keep_stamp=True)
    with h5py.File(bad, "r+") as f:
        column = f["feats"][:, 7]
        first = 0 if split == "train" else int(f["offsets"][-2])  # held-out: the last utt
        hit = np.arange(len(column)) >= first
        hit[sample_frames(len(column))] = False  # the stamp's fingerprint still matches
        column[hit] = np.nan
        f["feats"][:, 7] = column
        utt_ids = list(f["utt_ids"].asstr()[()])
    train, heldout = (bad, tiny_data[1]) if split == "train" else (tiny_data[0], bad)
    nprocs, extra = (1, ["--num-workers", "1"]) if split == "train" else (2, [])
    res = launch(nprocs, train, heldout, tmp_path / "o", "--max-steps", "2", *extra,
                 ends_job=True)
    assert res.returncode == 2, res.output[-4000:]
    errors = [ln for ln in res.stderr.splitlines() if "error: " in ln]
    assert errors and "Traceback" not in res.stderr, res.stderr[-4000:]
    line = errors[0]
    assert "nan.h5" in line and "non-finite feature value" in line, line
    assert any(f"({utt!r})" in line for utt in utt_ids), line
    assert "changed after it was validated" in line and f"{VALIDATE} {bad}" in line, line


def test_an_error_every_rank_finds_is_said_once_and_exits_2_cleanly(tiny_data, tmp_path):
    """A run directory that holds another run: every rank refuses it alike, so rank 0 says
    it once and every rank exits 2, with no abort banner after it."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "config.json").write_text("{}")
    res = launch(3, *tiny_data, out)
    assert res.returncode == 2, res.output[-4000:]
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("hadpsgd: error: --out-dir"), res.stderr
    assert "already holds a run" in lines[0] and "MPI_ABORT" not in res.output


def test_a_layout_error_every_rank_finds_is_said_once(tiny_data, tmp_path):
    """--ranks-per-node larger than the launch: every rank's comm.init refuses it alike
    (before any run directory), and rank 0 says it once, exit 2 (it was printed per rank)."""
    res = launch(2, *tiny_data, tmp_path / "r", "--ranks-per-node", "3")
    assert res.returncode == 2, res.output[-4000:]
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "ranks_per_node=3 is larger than the 2" in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_single_rank_refusal_names_the_file_and_the_fix(refused, name):
    """Each single-rank case of REFUSALS: exit 2 with one error line holding its phrases, no
    traceback, no start banner, no run directory."""
    res, out, (train, heldout) = refused[name]
    phrases = [p.format(train=train, heldout=heldout) for p in REFUSALS[name][1]]
    assert_refused(res, 1, out, *phrases)
