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


def test_speed_perturbation_triples_training_and_leaves_heldout_alone(recordings: Path,
                                                                     tmp_path: Path) -> None:
    plain, sp = tmp_path / "plain", tmp_path / "sp"
    assert fsdd.main([str(recordings), str(plain)]) == 0
    assert fsdd.main([str(recordings), str(sp), "--speed-perturb", "0.9,1.0,1.1"]) == 0
    with h5py.File(sp / "train.h5") as f:
        ids = [u.decode() for u in f["utt_ids"][()]]
        lengths = dict(zip(ids, np.diff(f["offsets"][()]), strict=True))
    with h5py.File(plain / "train.h5") as f:
        base = [u.decode() for u in f["utt_ids"][()]]
    assert len(ids) == 3 * len(base) == 48
    assert {u for u in ids if not u.startswith("sp")} == set(base)
    assert {u for u in ids if u.startswith("sp0.9-")} == {f"sp0.9-{u}" for u in base}
    u = base[0]  # 0.9: 1/0.9 of the length (slower), 1.1: 1/1.1 (Kaldi's sox speed)
    assert lengths[f"sp0.9-{u}"] > lengths[u] > lengths[f"sp1.1-{u}"]
    assert all(u.split("-")[-1] in ("0", "7") for u in ids)  # the reference stays last
    for name in ("heldout.h5", "heldout.text"):
        assert (sp / name).read_bytes() == (plain / name).read_bytes()


def test_speed_perturbation_refuses_bad_factors(recordings: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0.9,x", "0.1", "1.0,1.0"):
        assert fsdd.main([str(recordings), str(tmp_path / "o"), "--speed-perturb", bad]) == 2
        assert "--speed-perturb" in capsys.readouterr().err


def test_speed_is_sox_speed_on_a_tone() -> None:
    t = np.arange(8000) / fsdd.RATE
    x = np.sin(2 * np.pi * 500 * t)
    y = fsdd.speed(x, 1.25)  # 25 % faster: 0.8 s, 625 Hz
    assert len(y) == 6400
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) * fsdd.RATE / len(y) - 625) < 2
