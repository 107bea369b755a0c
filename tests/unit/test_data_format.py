"""The HDF5 feature format: writer validation, atomic writes, round trip, every reader error."""

from __future__ import annotations

import json
import os
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from hadpsgd.data import FORMAT_VERSION, FeatureFile, FeatureFileError, write_features
from hadpsgd.data.writer import FeatureWriter

D, C = 6, 5
LENGTHS = [5, 0, 7, 4]  # includes an empty utterance
IDS = ["utt-a", "utt-b", "utt-c", "utt-d"]


def make_data(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    feats = [rng.standard_normal((n, D)).astype(np.float32) for n in LENGTHS]
    labels = [rng.integers(0, C, size=n).astype(np.int32) for n in LENGTHS]
    return feats, labels


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.h5"
    feats, labels = make_data()
    write_features(path, feats, labels, IDS, C)
    return path


def corrupt(path: Path, edit: Callable[[h5py.File], None]) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs.pop("validated", None)  # a file from another writer: checked in full
        edit(f)


def replace(name: str, data: np.ndarray, **kw: object) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        del f[name]
        f.create_dataset(name, data=data, **kw)
    return edit


def assert_error(path: Path, phrase: str, **kw: object) -> FeatureFileError:
    with pytest.raises(FeatureFileError) as info:
        FeatureFile(path, **kw)  # type: ignore[arg-type]
    msg = str(info.value)
    assert path.name in msg, msg
    assert phrase in msg, msg
    return info.value


def test_round_trip_exact(good: Path) -> None:
    feats, labels = make_data()
    with FeatureFile(good) as ff:
        assert (ff.num_utts, ff.num_frames, ff.feat_dim, ff.num_classes) == (4, 16, D, C)
        assert ff.utt_ids == IDS
        np.testing.assert_array_equal(ff.offsets, [0, 5, 5, 12, 16])
        assert ff.offsets.dtype == np.int64
        assert ff.norm_mean is None and ff.norm_std is None
        x, y = ff.read(0, ff.num_frames)
        assert x.dtype == np.float32 and y.dtype == np.int64
        np.testing.assert_array_equal(x, np.concatenate(feats))
        np.testing.assert_array_equal(y, np.concatenate(labels))
        x, y = ff.read(5, 12)
        np.testing.assert_array_equal(x, feats[2])
        assert ff.read(3, 3)[0].shape == (0, D)
        assert ff.utterance_of(5) == 2  # the empty utterance 1 holds no frame


def test_layout_and_attributes(good: Path) -> None:
    with h5py.File(good) as f:
        assert f["feats"].dtype == np.float32 and f["feats"].chunks is not None
        assert f["labels"].dtype == np.int32 and f["offsets"].dtype == np.int64
        assert f.attrs["format_version"] == FORMAT_VERSION == 1
        assert f.attrs["num_classes"] == C and f.attrs["feat_dim"] == D
        assert [s.decode() for s in f["utt_ids"][()]] == IDS


def test_stamp_records_the_fingerprint_of_what_was_written(tmp_path: Path) -> None:
    # Written a chunk of 3 frames at a time: the labels' CRC streams across appends.
    feats, labels = make_data()
    path = tmp_path / "small-chunks.h5"
    write_features(path, feats, labels, IDS, C, chunk_frames=3)
    with h5py.File(path) as f:
        found = json.loads(f.attrs["validated"])
    every = np.concatenate(feats)
    rows = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # all 16 frames sampled
    assert found == {
        "version": 2, "finite": True, "labels_in_range": True, "frames": 16, "utts": 4,
        "num_classes": C, "feat_dim": D,
        "labels_crc32": zlib.crc32(np.concatenate(labels).astype("<i4").tobytes()),
        "offsets_crc32": zlib.crc32(np.array([0, 5, 5, 12, 16], "<i8").tobytes()),
        "feats_sample_crc32": zlib.crc32(every[rows].astype("<f4").tobytes())}
    assert FeatureFile(path).stamped


def test_norm_applied_on_read(tmp_path: Path) -> None:
    feats, labels = make_data()
    mean = np.arange(D, dtype=np.float32)
    std = np.linspace(0.5, 2.0, D, dtype=np.float32)
    path = tmp_path / "norm.h5"
    write_features(path, feats, labels, IDS, C, norm_mean=mean, norm_std=std)
    ff = FeatureFile(path)
    np.testing.assert_array_equal(ff.norm_mean, mean)
    x, _ = ff.read(0, ff.num_frames)
    np.testing.assert_allclose(x, (np.concatenate(feats) - mean) / std, rtol=1e-6, atol=1e-6)


def test_writer_validates_inputs(tmp_path: Path) -> None:
    feats, labels = make_data()
    path = tmp_path / "x.h5"
    cases = [
        ((feats, labels[:-1], IDS, C), "same length"),
        (([f[:, :3] if i == 2 else f for i, f in enumerate(feats)], labels, IDS, C), "shape"),
        ((feats, [lab + C for lab in labels], IDS, C), "outside"),
        ((feats, labels, ["a", "a", "b", "c"], C), "duplicate"),
        ((feats, [lab[:-1] if len(lab) else lab for lab in labels], IDS, C), "one per frame"),
        (([np.full((2, D), np.nan, np.float32)], [np.zeros(2, int)], ["n"], C), "NaN"),
        (([np.zeros(3, np.float32)], [np.zeros(3, int)], ["v"], C), "2-D"),
        (([], [], [], C), "no utterances"),
    ]
    for args, phrase in cases:
        with pytest.raises(ValueError, match=phrase):
            write_features(path, *args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both"):
        write_features(path, feats, labels, IDS, C, norm_mean=np.zeros(D))
    with pytest.raises(ValueError, match="shape"):
        write_features(path, feats, labels, IDS, C, norm_mean=np.zeros(D), norm_std=np.ones(3))
    assert list(tmp_path.iterdir()) == []  # nothing, not even a temporary file, left behind


def test_failed_write_keeps_old_file_and_leaves_no_temp(good: Path) -> None:
    before = good.read_bytes()
    feats, labels = make_data(seed=1)
    labels[3][0] = C  # invalid: fails after three utterances were already appended
    with pytest.raises(ValueError):
        write_features(good, feats, labels, IDS, C)
    assert good.read_bytes() == before
    assert sorted(p.name for p in good.parent.iterdir()) == [good.name]


def test_writer_context_manager_aborts_on_exception(tmp_path: Path) -> None:
    path = tmp_path / "w.h5"
    with pytest.raises(RuntimeError), FeatureWriter(path, D, C) as w:
        w.append("u", np.zeros((3, D)), np.zeros(3, int))
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    with FeatureWriter(path, D, C) as w:  # a normal exit commits
        w.append("u", np.ones((3, D)), np.zeros(3, int))
    assert FeatureFile(path).num_frames == 3


def test_running_norm_matches_numpy(tmp_path: Path) -> None:
    feats, labels = make_data()
    w = FeatureWriter(tmp_path / "n.h5", D, C)
    for utt, f, lab in zip(IDS, feats, labels, strict=True):
        w.append(utt, 100 + f, lab)  # an offset makes naive sum-of-squares lose precision
    mean, std = w.running_norm()
    w.commit((mean, std))
    every = 100 + np.concatenate(feats).astype(np.float64)
    np.testing.assert_allclose(mean, every.mean(0), rtol=1e-6)
    np.testing.assert_allclose(std, every.std(0), rtol=1e-4)


# ----------------------------------------------------------------------- reader errors
T = sum(LENGTHS)
CORRUPTIONS = {
    "missing feats": (lambda f: f.__delitem__("feats"), "missing dataset 'feats'"),
    "missing labels": (lambda f: f.__delitem__("labels"), "missing dataset 'labels'"),
    "missing offsets": (lambda f: f.__delitem__("offsets"), "missing dataset 'offsets'"),
    "missing utt_ids": (lambda f: f.__delitem__("utt_ids"), "missing dataset 'utt_ids'"),
    "missing num_classes": (lambda f: f.attrs.__delitem__("num_classes"),
                            "missing attribute 'num_classes'"),
    "missing version": (lambda f: f.attrs.__delitem__("format_version"),
                        "missing attribute 'format_version'"),
    "version": (lambda f: f.attrs.__setitem__("format_version", 2),
                "unsupported format_version 2"),
    "feat_dim attr": (lambda f: f.attrs.__setitem__("feat_dim", D + 1), "feature-dim mismatch"),
    # Another tool's (or a hand edit's) attribute that is no integer: named, not a bare
    # "invalid literal for int()".
    "num_classes string": (lambda f: f.attrs.__setitem__("num_classes", "five"),
                           "attribute 'num_classes' must be one integer, got 'five'"),
    "feat_dim array": (lambda f: f.attrs.__setitem__("feat_dim", np.array([D, D])),
                       "attribute 'feat_dim' must be one integer"),
    "version NaN": (lambda f: f.attrs.__setitem__("format_version", np.nan),
                    "attribute 'format_version' must be one integer, got nan"),
    "num_classes fraction": (lambda f: f.attrs.__setitem__("num_classes", 5.5),
                             "attribute 'num_classes' must be one integer, got 5.5"),
    "feats 1-D": (replace("feats", np.zeros(T, np.float32)), "2-D float"),
    "labels length": (replace("labels", np.zeros(T - 1, np.int32)), "'labels' has 15 entries"),
    "offsets start": (replace("offsets", np.array([1, 5, 5, 12, 16])), "start at 0"),
    "offsets order": (replace("offsets", np.array([0, 5, 4, 12, 16])),
                      "not monotonic non-decreasing"),
    "offsets end": (replace("offsets", np.array([0, 5, 5, 12, 15])), "offsets end at 15"),
    "utt_ids length": (replace("utt_ids", np.array([b"a", b"b", b"c"])), "'utt_ids' has shape"),
    "utt_ids not str": (replace("utt_ids", np.arange(4)), "'utt_ids' must hold strings"),
    "label too big": (replace("labels", np.full(T, C, np.int32)), "outside [0, num_classes=5)"),
    "label negative": (replace("labels", np.full(T, -1, np.int32)), "label -1 at frame 0"),
    "norm shape": (lambda f: (f.create_dataset("norm/mean", data=np.zeros(D + 1, np.float32)),
                              f.create_dataset("norm/std", data=np.ones(D + 1, np.float32))),
                   "norm shape mismatch"),
    "norm half": (lambda f: f.create_dataset("norm/mean", data=np.zeros(D, np.float32)),
                  "present together"),
    "norm zero std": (lambda f: (f.create_dataset("norm/mean", data=np.zeros(D, np.float32)),
                                 f.create_dataset("norm/std", data=np.zeros(D, np.float32))),
                      "finite and > 0"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_reader_rejects_corruption(good: Path, case: str) -> None:
    edit, phrase = CORRUPTIONS[case]
    corrupt(good, edit)
    assert_error(good, phrase)


def test_reader_rejects_expected_feat_dim(good: Path) -> None:
    err = assert_error(good, "feature-dim mismatch", expected_feat_dim=D + 2)
    assert f"{D + 2} are expected" in str(err)
    assert FeatureFile(good, expected_feat_dim=D).feat_dim == D


def test_reader_rejects_missing_and_non_hdf5(tmp_path: Path) -> None:
    assert_error(tmp_path / "nope.h5", "does not exist")
    bogus = tmp_path / "bogus.h5"
    bogus.write_text("not hdf5")
    assert_error(bogus, "not a readable HDF5 file")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_frames_detected_on_read(good: Path, value: float) -> None:
    def put(f: h5py.File) -> None:
        f["feats"][8, 2] = value  # frame 8 is in utterance 2 ("utt-c", frames 5..11)
    corrupt(good, put)
    ff = FeatureFile(good)  # metadata is fine: opening succeeds
    ff.read(0, 8)  # a range without the bad frame reads fine
    with pytest.raises(FeatureFileError) as info:
        ff.read(6, 10)
    msg = str(info.value)
    assert good.name in msg and "frame 8" in msg and "[6, 10)" in msg and "'utt-c'" in msg


def test_read_range_checked(good: Path) -> None:
    ff = FeatureFile(good)
    for start, stop in [(-1, 2), (3, 2), (0, T + 1)]:
        with pytest.raises(IndexError, match="good.h5"):
            ff.read(start, stop)


def test_pickle_and_reopen_in_new_process(good: Path) -> None:
    ff = FeatureFile(good)
    first = ff.read(0, 5)
    clone = pickle.loads(pickle.dumps(ff))
    assert clone._h5 is None  # handles are never pickled
    np.testing.assert_array_equal(clone.read(0, 5)[0], first[0])
    old = ff._h5
    ff._pid = os.getpid() + 1  # pretend the handle was inherited from another process
    np.testing.assert_array_equal(ff.read(0, 5)[0], first[0])
    assert ff._h5 is not old and ff._pid == os.getpid()
    ff.close()
    old.close()
