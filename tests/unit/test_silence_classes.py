"""Silence classes: recorded in the feature file, and speech-frame accuracy in evaluation."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hadpsgd.data import ChunkDataset, FeatureFile, mark_silence, write_features
from hadpsgd.data.__main__ import main as data_main
from hadpsgd.data.loader import IGNORE
from hadpsgd.models import build_model
from hadpsgd.train.evaluate import evaluate, speech_note
from tests.fakes import OneLearner

SIL = 4


def small_file(path: Path, silence: tuple[int, ...] = ()) -> Path:
    rng = np.random.default_rng(0)
    lengths = [9, 17, 12, 30]
    feats = [rng.standard_normal((n, 6)).astype(np.float32) for n in lengths]
    # Every utterance starts and ends in silence (class 4), as a corpus's do.
    labels = [np.concatenate([[SIL] * 3, rng.integers(0, SIL, n - 6), [SIL] * 3])
              for n in lengths]
    write_features(path, feats, labels, [f"u{i}" for i in range(4)], num_classes=5,
                   silence_classes=silence)
    return path


def test_writer_records_and_reader_reads(tmp_path: Path) -> None:
    assert FeatureFile(small_file(tmp_path / "a.h5", (SIL,))).silence_classes == (SIL,)
    assert FeatureFile(small_file(tmp_path / "b.h5")).silence_classes == ()
    with pytest.raises(ValueError, match=r"silence classes \[7\] are outside"):
        small_file(tmp_path / "c.h5", (7,))


def test_reader_refuses_out_of_range_attribute(tmp_path: Path) -> None:
    path = small_file(tmp_path / "a.h5")
    with h5py.File(path, "r+") as h5:
        h5.attrs["silence_classes"] = np.array([2, 9], np.int32)
    with pytest.raises(ValueError, match=r"silence classes \[9\] are outside \[0, "
                                         r"num_classes=5\).*mark-silence"):
        FeatureFile(path)


def test_mark_silence_keeps_the_stamp(tmp_path: Path) -> None:
    path = small_file(tmp_path / "a.h5")
    assert FeatureFile(path).stamped
    assert mark_silence(path, [SIL, SIL]) == (SIL,)
    again = FeatureFile(path)
    assert again.silence_classes == (SIL,) and again.stamped
    mark_silence(path, [])
    assert FeatureFile(path).silence_classes == ()


def test_mark_silence_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = small_file(tmp_path / "a.h5")
    assert data_main(["mark-silence", str(path), "4"]) == 0
    assert data_main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "silence classes 4" in out and "silence classes: 4 (" in out
    assert data_main(["mark-silence", str(path), "5"]) == 2
    assert "outside [0, num_classes=5)" in capsys.readouterr().err
    assert FeatureFile(path).silence_classes == (SIL,)  # the refused call changed nothing


def test_speech_accuracy_against_a_frame_by_frame_reference(tmp_path: Path) -> None:
    path = small_file(tmp_path / "a.h5", (SIL,))
    ds = ChunkDataset(path, chunk_len=5, expected_feat_dim=6)
    torch.manual_seed(0)
    model = build_model("tiny", 6, 5)
    got = evaluate(model, ds, OneLearner(), batch_size=3)
    # Reference: every chunk at once; speech = counted frames whose label is not silence.
    x, y = ds.__getitems__(list(range(len(ds))))
    with torch.no_grad():
        pred = model(x).argmax(-1).reshape(-1)
    y = y.reshape(-1)
    speech = (y != IGNORE) & (y != SIL)
    assert got.speech_frames == int(speech.sum()) == int(
        (ds.file.read(0, ds.file.num_frames)[1] != SIL).sum())
    assert got.speech_accuracy == (pred[speech] == y[speech]).double().mean().item()
    assert speech_note(got) == f", on speech frames {got.speech_accuracy:.4f}"
    # Without the attribute: no speech figure, the rest unchanged.
    plain = evaluate(model, ChunkDataset(small_file(tmp_path / "b.h5"), chunk_len=5),
                     OneLearner(), batch_size=3)
    assert plain.speech_accuracy is None and plain.speech_frames == 0
    assert (plain.loss, plain.accuracy) == (got.loss, got.accuracy) and speech_note(plain) == ""
