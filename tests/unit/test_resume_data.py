"""The data fingerprints a checkpoint records, and what a resume makes of them (no processes)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hadpsgd.assembly.resume_data import check_resume_data, data_changes, identity
from hadpsgd.cli import ConfigError
from hadpsgd.data import FeatureFile, write_features


def _file(path: Path, seed: int, n_utts: int = 4) -> FeatureFile:
    rng = np.random.default_rng(seed)
    feats = [rng.standard_normal((7, 3)).astype(np.float32) for _ in range(n_utts)]
    labels = [rng.integers(0, 5, 7) for _ in range(n_utts)]
    write_features(path, feats, labels, [f"u{i}" for i in range(n_utts)], 5)
    return FeatureFile(path)


def test_the_same_files_match_and_other_data_under_a_path_is_named(tmp_path: Path) -> None:
    train, heldout = _file(tmp_path / "t.h5", 0), _file(tmp_path / "h.h5", 1)
    saved = identity(train, heldout)
    assert data_changes(saved, identity(FeatureFile(train.path), FeatureFile(heldout.path))) == []
    # One frame's value differs (same shape and labels): the sampled frames' checksum says so.
    other = _file(tmp_path / "t.h5", 0)
    with h5py.File(other.path, "r+") as h5:
        h5["feats"][0, 0] += 1.0
    now = identity(FeatureFile(other.path, verify=True), heldout)
    assert data_changes(saved, now) == [("train", "feats sample checksum")]
    now = identity(_file(tmp_path / "t.h5", 2, n_utts=5), heldout)
    (split, what), = data_changes(saved, now)
    assert split == "train" and "frames 28 -> 35" in what and "utts 4 -> 5" in what


def test_a_resume_refuses_it_unless_allowed_and_old_checkpoints_pass(tmp_path: Path) -> None:
    train, heldout = _file(tmp_path / "t.h5", 0), _file(tmp_path / "h.h5", 1)
    saved = {"data_identity": identity(train, heldout)}
    now = identity(_file(tmp_path / "t.h5", 3), heldout)
    with pytest.raises(ConfigError, match=r"--train .*t\.h5 \(labels checksum.*"
                                          r"--allow-resume-change train"):
        check_resume_data(Path("ck"), saved, now, set())
    assert check_resume_data(Path("ck"), saved, now, {"train"}) == [
        "--train data (labels checksum, feats sample checksum)"]
    assert check_resume_data(Path("ck"), {}, now, set()) == []  # written before fingerprints
    assert check_resume_data(None, saved, now, set()) == []  # a fresh start


def test_ranks_reading_other_data_under_the_same_path_are_named(tmp_path: Path) -> None:
    from hadpsgd.assembly.resume_data import check_same_data

    train, heldout = _file(tmp_path / "t.h5", 0), _file(tmp_path / "h.h5", 1)
    same = identity(train, heldout)
    check_same_data([same, same, same], ["a", "a", "b"])
    stale = identity(_file(tmp_path / "old.h5", 0, n_utts=3), heldout)
    with pytest.raises(ConfigError, match=r"other data than rank 0 \(on a\).*rank 2 on b: "
                                          r"--train .*old\.h5 \(frames 28 -> 21.*every host"):
        check_same_data([same, same, stale], ["a", "a", "b"])
