"""Every bad input is refused up front with a message naming the file and the fix.

One test per case of the bad-input list: truncated, missing dataset, wrong feature dimension,
NaN/Inf frames, labels out of range, empty, offsets/utt_ids mismatch, unreadable path; then
the ``validated`` stamp: its fingerprint, a file changed in place after it was stamped, and
``python -m hadpsgd.data validate``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from hadpsgd.assembly.data import (
    _scan_share,
    check_chunk_len,
    check_steps,
    heldout_overlap,
    validate_data,
)
from hadpsgd.data import (
    ChunkBatchSampler,
    ChunkDataset,
    FeatureFile,
    FeatureFileError,
    make_loader,
    write_features,
)
from hadpsgd.data.__main__ import main as data_main
from hadpsgd.data.validate import nonfinite_error, path_problem, scan_frames
from hadpsgd.data.validate_stamp import STAMP_VERSION, crc32_of, sample_frames

D, C = 6, 5
LENGTHS = [5, 0, 7, 4, 9, 3]  # includes an empty utterance
IDS = [f"utt-{c}" for c in "abcdef"]
T = sum(LENGTHS)
# Phrases of the fix hints the messages carry.
REWRITE = "rewrite it with hadpsgd.data.write_features"
DAMAGED = "copy it again or regenerate it"


@pytest.fixture
def good(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "good.h5"
    write_features(path, [rng.standard_normal((n, D)).astype(np.float32) for n in LENGTHS],
                   [rng.integers(0, C, size=n).astype(np.int32) for n in LENGTHS], IDS, C)
    return path


def edit(path: Path, **datasets: np.ndarray) -> None:
    """Damage a file; its writer's stamp goes too (a file from another writer)."""
    with h5py.File(path, "r+") as f:
        f.attrs.pop("validated", None)
        for name, data in datasets.items():
            del f[name]
            f.create_dataset(name, data=data)


def open_error(path: Path, *phrases: str, **kw: object) -> str:
    with pytest.raises(FeatureFileError) as info:
        FeatureFile(path, **kw)  # type: ignore[arg-type]
    msg = str(info.value)
    assert path.name in msg, msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


def put_value(path: Path, frame: int, value: float) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs.pop("validated", None)  # damage from another writer: no stamp vouches
        f["feats"][frame, 3] = value


def damage_chunk(path: Path, frame: int) -> None:
    """Store ``feats`` gzip-compressed in 4-frame chunks and garble the one holding ``frame``.

    The metadata and labels stay intact, so the file opens and only reading those frames
    fails: the damage a scan must turn into a named error.
    """
    with h5py.File(path, "r+") as f:
        f.attrs.pop("validated", None)
        feats = f["feats"][()]
        del f["feats"]
        f.create_dataset("feats", data=feats, chunks=(4, D), compression="gzip")
        info = f["feats"].id.get_chunk_info_by_coord((frame // 4 * 4, 0))
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(b"\xff" * info.size)  # not a deflate stream: the filter fails


# ------------------------------------------------------------------ 1. truncated
def test_truncated_file_is_refused_at_open(good: Path) -> None:
    data = good.read_bytes()
    good.write_bytes(data[:len(data) // 2])
    open_error(good, "truncated", DAMAGED)


def test_damaged_frames_fail_the_scan_naming_frames(good: Path) -> None:
    damage_chunk(good, 13)
    ff = FeatureFile(good)  # metadata and labels are intact
    assert scan_frames(ff, 0, 12) is None  # chunks before the damage read fine
    with pytest.raises(FeatureFileError) as info:
        scan_frames(ff, 0, T, block_frames=4)
    msg = str(info.value)
    assert good.name in msg and "cannot read frames [12, 16)" in msg and DAMAGED in msg


def test_damaged_labels_fail_at_open(good: Path) -> None:
    with h5py.File(good, "r+") as f:
        f.attrs.pop("validated", None)
        labels = f["labels"][()]
        del f["labels"]
        f.create_dataset("labels", data=labels, chunks=(8,), compression="gzip")
        info = f["labels"].id.get_chunk_info(0)
    with open(good, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(b"\xff" * info.size)
    open_error(good, "cannot read the file's metadata or labels", DAMAGED)


# ------------------------------------------------------------------ 2. missing dataset
@pytest.mark.parametrize("name", ["feats", "labels", "offsets", "utt_ids"])
def test_missing_dataset(good: Path, name: str) -> None:
    with h5py.File(good, "r+") as f:
        del f[name]
    open_error(good, f"missing dataset '{name}'", REWRITE)


# ------------------------------------------------------------------ 3. feature dimension
def test_feat_dim_attribute_mismatch(good: Path) -> None:
    with h5py.File(good, "r+") as f:
        f.attrs["feat_dim"] = D + 1
    open_error(good, "feature-dim mismatch", f"feat_dim={D + 1}", REWRITE)


def test_feat_dim_differs_from_expected(good: Path) -> None:
    open_error(good, "feature-dim mismatch", f"{D + 2} are expected", "use matching data",
               expected_feat_dim=D + 2)


# ------------------------------------------------------------------ 4. NaN / Inf
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("block", [None, 1, 4, 7])
def test_scan_finds_first_non_finite_frame(good: Path, value: float, block: int | None) -> None:
    put_value(good, 19, value)  # frame 19: utterance 4 ("utt-e", frames 16..24)
    put_value(good, 22, value)
    ff = FeatureFile(good)  # opening does not read the frames: it succeeds
    assert scan_frames(ff, 0, T, block_frames=block) == 19
    assert scan_frames(ff, 20, T, block_frames=block) == 22
    assert scan_frames(ff, 0, 19, block_frames=block) is None
    assert scan_frames(ff, 23, T, block_frames=block) is None
    assert scan_frames(ff, 5, 5, block_frames=block) is None
    msg = str(nonfinite_error(ff, 19))
    assert good.name in msg and "frame 19" in msg and "'utt-e'" in msg and "rewrite" in msg


def test_scan_range_checked(good: Path) -> None:
    ff = FeatureFile(good)
    for start, stop in [(-1, 2), (3, 2), (0, T + 1)]:
        with pytest.raises(IndexError, match="good.h5"):
            scan_frames(ff, start, stop)
    with pytest.raises(ValueError, match="block_frames"):
        scan_frames(ff, 0, T, block_frames=0)


@dataclass
class OneOfTwo:
    """Rank 0 of a two-rank Topology whose peer's share is scanned here, for the agreement."""

    files: tuple[FeatureFile, ...]
    rank: int = 0
    size: int = 2

    def allgather_object(self, local: list[object]) -> list[list[object]]:
        # the peer scans what every rank scans: the files no writer's stamp vouches for
        return [local, [_scan_share(ff, 1, 2) for ff in self.files if not ff.stamped]]


def test_validate_data_reports_the_peers_share(good: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    other.write_bytes(good.read_bytes())
    put_value(good, T - 2, np.nan)  # only in the second half: rank 1's share
    files = (FeatureFile(other), FeatureFile(good))
    assert _scan_share(files[1], 0, 2) is None  # rank 0 alone sees nothing wrong
    with pytest.raises(FeatureFileError) as info:
        validate_data(files, OneOfTwo(files))  # type: ignore[arg-type]
    msg = str(info.value)
    assert "good.h5" in msg and f"frame {T - 2}" in msg and "'utt-f'" in msg


def test_validate_data_shares_read_errors(good: Path) -> None:
    damage_chunk(good, T - 1)
    files = (FeatureFile(good),)
    assert _scan_share(files[0], 0, 2) is None
    with pytest.raises(FeatureFileError, match="cannot read frames"):
        validate_data(files, OneOfTwo(files))  # type: ignore[arg-type]


def test_validate_data_accepts_clean_files(good: Path) -> None:
    ff = FeatureFile(good)
    validate_data([ff], OneOfTwo((ff,)))  # type: ignore[arg-type]
    assert ff._h5 is None  # the scan's handle is closed before loader workers fork


# ------------------------------------------------------------------ 5. labels out of range
def test_label_out_of_range(good: Path) -> None:
    labels = np.zeros(T, np.int32)
    labels[7] = C
    edit(good, labels=labels)
    open_error(good, f"label {C} at frame 7", "outside [0, num_classes=5)",
               "num_classes attribute is too small")


# ------------------------------------------------------------------ 6. empty
def test_zero_byte_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.h5"
    empty.touch()
    open_error(empty, "empty (0 bytes)", DAMAGED)


def test_file_without_utterances(good: Path) -> None:
    edit(good, feats=np.zeros((0, D), np.float32), labels=np.zeros(0, np.int32),
         offsets=np.zeros(1, np.int64), utt_ids=np.array([], dtype=h5py.string_dtype()))
    open_error(good, "has no utterances", "regenerate")


def test_file_without_frames(good: Path) -> None:
    edit(good, feats=np.zeros((0, D), np.float32), labels=np.zeros(0, np.int32),
         offsets=np.zeros(len(IDS) + 1, np.int64))
    open_error(good, "has no frames", f"{len(IDS)} utterances are all empty", "regenerate")


def test_fewer_chunks_than_one_global_batch(good: Path) -> None:
    train = ChunkDataset(good, chunk_len=2)  # 2+0+3+2+4+1 = 12 whole chunks and 4 tails
    check_steps(train, batch_size=4, world_size=4)  # exactly one step: fine
    with pytest.raises(FeatureFileError) as info:
        check_steps(train, batch_size=5, world_size=4)
    msg = str(info.value)
    for phrase in ("good.h5", "16 chunks of 2 frames", "global batch of 20", "zero steps",
                   "--batch-size", "--chunk-len", "more training data"):
        assert phrase in msg, msg


def test_a_chunk_longer_than_every_utterance_is_refused(good: Path) -> None:
    check_chunk_len(ChunkDataset(good, chunk_len=max(LENGTHS)))  # the longest: one chunk
    with pytest.raises(FeatureFileError, match=r"--chunk-len 10 is longer than the longest "
                                               r"utterance of .*good\.h5 \(9 frames\).*"
                                               r"--chunk-len 9 or less"):
        check_chunk_len(ChunkDataset(good, chunk_len=10))


def test_heldout_that_is_training_data_is_said(good: Path, tmp_path: Path) -> None:
    assert "is the training file" in heldout_overlap(FeatureFile(good), FeatureFile(good))
    other = tmp_path / "other.h5"
    rng = np.random.default_rng(0)
    write_features(other, [rng.standard_normal((3, D)).astype(np.float32)] * 2,
                   [np.zeros(3, np.int64)] * 2, [IDS[0], "new"], C)
    note = heldout_overlap(FeatureFile(good), FeatureFile(other))
    assert note.startswith("1 of the 2 utterances of --heldout") and "not on unseen" in note
    write_features(other, [rng.standard_normal((3, D)).astype(np.float32)],
                   [np.zeros(3, np.int64)], ["new"], C)
    assert heldout_overlap(FeatureFile(good), FeatureFile(other)) is None


def test_heldout_shorter_than_a_chunk_is_still_evaluated(good: Path) -> None:
    # Every utterance is shorter than 10 frames: each becomes one padded chunk.
    heldout = ChunkDataset(good, chunk_len=10)
    assert len(heldout) == 5  # the five non-empty utterances


# ------------------------------------------------------------------ 7. offsets / utt_ids
def test_offsets_and_utt_ids_disagree(good: Path) -> None:
    edit(good, utt_ids=np.array([b"a", b"b", b"c"]))
    open_error(good, "'utt_ids' has shape [3]", f"describes {len(IDS)} utterances", REWRITE)


def test_offsets_do_not_end_at_frame_count(good: Path) -> None:
    edit(good, offsets=np.array([0, 5, 5, 12, 16, 25, T - 1]))
    open_error(good, f"offsets end at {T - 1}", REWRITE)


# ------------------------------------------------------------------ 8. unreadable path
def test_path_is_a_directory(tmp_path: Path) -> None:
    open_error(tmp_path, "is a directory", "pass the .h5 file inside it")


def test_path_does_not_exist(tmp_path: Path) -> None:
    open_error(tmp_path / "nope.h5", "does not exist", "check the path")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_path_without_read_permission(good: Path) -> None:
    good.chmod(0)
    try:
        open_error(good, "permission denied", "chmod a+r")
    finally:
        good.chmod(0o644)


def test_unreadable_path_as_root_sees_it(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, which chmod cannot lock out: answer as an unprivileged user would.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    open_error(good, "permission denied", "chmod a+r")


def test_path_problem_accepts_a_good_file(good: Path) -> None:
    assert path_problem(good) is None


# ------------------------------------------------------------------ the stamp
VALIDATE = "python -m hadpsgd.data validate"
CHANGED = "changed after it was validated"


def stamp_of(path: Path) -> dict[str, object]:
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["validated"])


def unsampled(frame: int) -> int:
    """The first frame from ``frame`` on that the stamp's fingerprint does not read."""
    while frame in sample_frames(T):
        frame += 1
    return frame


def test_writer_stamp_fingerprints_the_data(good: Path) -> None:
    ff = FeatureFile(good)
    assert ff.stamped and not ff.old_stamp
    found = stamp_of(good)
    assert found == ff.current_stamp()
    assert found["version"] == STAMP_VERSION and found["frames"] == T
    assert {"labels_crc32", "offsets_crc32", "feats_sample_crc32"} <= set(found)


def test_crc_streams_over_blocks_and_ignores_byte_order() -> None:
    values = np.arange(-50, 50, dtype=np.int32)
    assert crc32_of(values[60:], crc32_of(values[:60])) == crc32_of(values)
    assert crc32_of(values.astype(">i4")) == crc32_of(values)
    assert sample_frames(T)[0] == 0 and sample_frames(T)[-1] == T - 1
    assert sample_frames(3) == [0, 1, 2] and len(sample_frames(10**8)) == 16


@pytest.mark.parametrize("value", [9999, -1])
@pytest.mark.parametrize("verify", [False, True], ids=["stamp", "verify"])
def test_labels_out_of_range_in_a_stamped_file(good: Path, value: int, verify: bool) -> None:
    with h5py.File(good, "r+") as f:  # edited in place: the stamp stays
        f["labels"][3] = value
        f["labels"][20] = value
    lo, hi = min(value, 0), max(value, C - 1)
    open_error(good, f"label {value} at frame 3 (utterance 0, 'utt-a')", "2 frames out of range",
               f"labels span [{lo}, {hi}]", CHANGED, f"{VALIDATE} {good}", verify=verify)


def test_label_changed_in_range_voids_the_stamp(good: Path) -> None:
    with h5py.File(good, "r+") as f:
        f["labels"][3] = (f["labels"][3] + 1) % C
    open_error(good, CHANGED, "the labels' checksum differs", f"re-validate it with {VALIDATE}")
    assert not FeatureFile(good, verify=True).stamped  # a full check does not need the stamp


def test_sampled_frame_changed_voids_the_stamp(good: Path) -> None:
    with h5py.File(good, "r+") as f:
        f["feats"][sample_frames(T)[5], 0] += 1.0
    open_error(good, CHANGED, "sampled feature frames differs", VALIDATE)


def test_shape_changed_voids_the_stamp(good: Path) -> None:
    with h5py.File(good, "r+") as f:
        f.attrs["validated"] = json.dumps({**stamp_of(good), "frames": T + 1})
    open_error(good, CHANGED, f"frames {T} (the stamp has {T + 1})", VALIDATE)


def test_nan_frame_outside_the_sample_is_named_when_read(good: Path) -> None:
    frame = unsampled(19)  # utterance 4, "utt-e" (frames 16..24)
    with h5py.File(good, "r+") as f:
        f["feats"][frame, 2] = np.nan
    ff = FeatureFile(good)
    assert ff.stamped  # trusted: the frames are too many to read at open
    with pytest.raises(FeatureFileError) as info:
        ff.read(16, 25)
    msg = str(info.value)
    for phrase in (good.name, f"frame {frame}", "'utt-e'", CHANGED, f"{VALIDATE} {good}"):
        assert phrase in msg, msg


def test_a_worker_s_bad_frame_is_raised_as_itself(good: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import hadpsgd.data.loader as loader

    with h5py.File(good, "r+") as f:
        f["feats"][unsampled(6), 0] = np.inf  # utterance 2, "utt-c"
    data = ChunkDataset(good, chunk_len=4)
    # As in a worker process: the error comes back as a batch, the loader raises it.
    monkeypatch.setattr(loader, "get_worker_info", lambda: object())
    assert isinstance(data.__getitems__(list(range(len(data)))), loader.WorkerFailure)
    sampler = ChunkBatchSampler(len(data), 4, 0, 1, seed=0, shuffle=False, drop_last=False)
    with pytest.raises(FeatureFileError) as info:
        list(make_loader(data, sampler))
    msg = str(info.value)
    assert "'utt-c'" in msg and "Traceback" not in msg, msg


def test_older_stamp_vouches_for_nothing(good: Path) -> None:
    old = {k: v for k, v in stamp_of(good).items() if "crc" not in k and k != "version"}
    with h5py.File(good, "r+") as f:
        f.attrs["validated"] = json.dumps(old)  # what hadpsgd wrote before fingerprints
    ff = FeatureFile(good)
    assert ff.old_stamp and not ff.stamped  # the frames are scanned before training
    put_value(good, 9, np.nan)
    with pytest.raises(FeatureFileError, match="frame 9"):
        validate_data([ff], OneOfTwo((ff,)))  # type: ignore[arg-type]


def test_validate_command_restamps_a_file_changed_on_purpose(
        good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with h5py.File(good, "r+") as f:
        f["labels"][3] = (f["labels"][3] + 1) % C
    open_error(good, CHANGED)
    assert data_main(["validate", str(good)]) == 0
    assert f"{good}: valid: {len(IDS)} utterances, {T} frames" in capsys.readouterr().out
    assert FeatureFile(good).stamped
    assert data_main(["info", str(good)]) == 0
    assert "validated stamp: matches" in capsys.readouterr().out


def test_validate_command_refuses_a_bad_file_and_drops_its_stamp(
        good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frame = unsampled(19)
    with h5py.File(good, "r+") as f:
        f["feats"][frame, 0] = np.nan
    assert data_main(["validate", str(good)]) == 2
    err = capsys.readouterr().err
    assert f"frame {frame}" in err and "'utt-e'" in err, err
    ff = FeatureFile(good)
    assert not ff.stamped and not ff.old_stamp  # no stamp: training scans, and refuses it
    with pytest.raises(FeatureFileError, match=f"frame {frame}"):
        validate_data([ff], OneOfTwo((ff,)))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [9999, -1])
def test_info_reports_labels_out_of_range(good: Path, value: int,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with h5py.File(good, "r+") as f:
        f["labels"][7] = value
    assert data_main(["info", str(good)]) == 2
    err = capsys.readouterr().err
    assert f"label {value} at frame 7" in err and "1 frame out of range" in err, err
