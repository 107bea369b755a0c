"""The FSDD fold builder (examples/digits/fsdd.py) on synthetic recordings named as FSDD's."""

from __future__ import annotations

import wave
from pathlib import Path

import h5py
import numpy as np
import pytest

from examples.digits import fsdd


def _wav(path: Path, word: np.ndarray, pad: int = 800) -> None:
    x = np.concatenate([np.zeros(pad), word, np.zeros(pad)])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(fsdd.RATE)
        w.writeframes((x * 20000).astype("<i2").tobytes())


@pytest.fixture()
def recordings(tmp_path: Path) -> Path:
    rec = tmp_path / "recordings"
    rec.mkdir()
    t = np.arange(2400) / fsdd.RATE  # a 0.3 s word between 0.1 s of silence each side
    for speaker in fsdd.SPEAKERS:
        for digit in (0, 7):
            for take in range(2):
                _wav(rec / f"{digit}_{speaker}_{take}.wav",
                     0.5 * np.sin(2 * np.pi * (300 + 50 * digit) * t))
    return rec


def test_a_fold_holds_out_its_two_speakers(recordings: Path, tmp_path: Path) -> None:
    out = tmp_path / "foldC"
    assert fsdd.main([str(recordings), str(out), "--fold", "C"]) == 0
    with h5py.File(out / "heldout.h5") as f:
        ids = [u.decode() for u in f["utt_ids"][()]]
        labels, feats = f["labels"][()], f["feats"][()]
    assert {u.split("-")[0] for u in ids} == {"george", "lucas"} and len(ids) == 8
    assert all(u.endswith(("-0", "-7")) for u in ids)  # the reference is the id's last word
    assert feats.shape[1] == fsdd.FEAT_DIM and np.isfinite(feats).all()
    with h5py.File(out / "train.h5") as f:
        train_ids = [u.decode() for u in f["utt_ids"][()]]
    assert not {u.split("-")[0] for u in train_ids} & {"george", "lucas"}
    assert len(train_ids) == 16
    # 0.5 s: 0.1 s silence, 0.3 s word in three states, 0.1 s silence
    first = labels[:fsdd.frames_of(np.zeros(4000))]
    assert first[0] == first[-1] == fsdd.SILENCE_CLASS
    states = [c for c in dict.fromkeys(first.tolist()) if c != fsdd.SILENCE_CLASS]
    assert states in ([0, 1, 2], [21, 22, 23])
    assert 0.3 < float((first == fsdd.SILENCE_CLASS).mean()) < 0.55
    text = (out / "heldout.text").read_text().splitlines()
    assert len(text) == 8 and text[0].split()[1] in ("0", "7")


def test_no_recordings_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert fsdd.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "free-spoken-digit-dataset" in capsys.readouterr().err
