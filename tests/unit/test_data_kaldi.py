"""Importing Kaldi feature archives and pdf-id alignments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

kaldiio = pytest.importorskip("kaldiio")

from hadpsgd.data import FeatureFile, write_features  # noqa: E402
from hadpsgd.data.kaldi import import_kaldi, main, rspecifier  # noqa: E402

D = 5
LENGTHS = {"spk1-u1": 10, "spk1-u2": 7, "spk2-noali": 4, "spk2-short": 6, "spk2-u3": 3}


@pytest.fixture
def kaldi_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    feats = {u: rng.standard_normal((n, D)).astype(np.float32) for u, n in LENGTHS.items()}
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path / 'feats.ark'},{tmp_path / 'feats.scp'}") as w:
        for utt, mat in feats.items():
            w(utt, mat)
    ali = {u: rng.integers(0, 9, size=n).astype(np.int32) for u, n in LENGTHS.items()
           if u != "spk2-noali"}
    ali["spk2-short"] = ali["spk2-short"][:5]  # one frame short: a length mismatch
    ali["spk1-u2"][0] = 11  # the largest pdf-id: num_classes defaults to 12
    ali["only-ali"] = np.zeros(3, np.int32)  # an alignment without features
    kaldiio.save_ark(str(tmp_path / "ali.ark"), ali, scp=str(tmp_path / "ali.scp"))
    np.savez(tmp_path / "expected.npz", **{f"f/{u}": m for u, m in feats.items()},
             **{f"a/{u}": a for u, a in ali.items()})
    return tmp_path


def expected(kaldi_dir: Path, utts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(kaldi_dir / "expected.npz")
    return (np.concatenate([data[f"f/{u}"] for u in utts]),
            np.concatenate([data[f"a/{u}"] for u in utts]))


GOOD = ["spk1-u1", "spk1-u2", "spk2-u3"]


@pytest.mark.parametrize("ali", ["ali.ark", "ark:ali.ark", "ali.scp", "scp:ali.scp"])
def test_import_round_trip(kaldi_dir: Path, ali: str) -> None:
    prefix, _, name = ali.rpartition(":")
    spec = f"{prefix}:{kaldi_dir / name}" if prefix else str(kaldi_dir / name)
    out = kaldi_dir / "train.h5"
    summary = import_kaldi(str(kaldi_dir / "feats.scp"), spec, out, compute_norm=False)
    assert summary["utts"] == 3 and summary["frames"] == 20
    assert summary["num_classes"] == 12 and summary["feat_dim"] == D
    assert summary["skipped"] == {"no alignment": 1, "length mismatch": 1}
    assert summary["skipped_utts"] == {"no alignment": ["spk2-noali"],
                                       "length mismatch": ["spk2-short"]}
    assert summary["unused_alignments"] == 1
    ff = FeatureFile(out)
    assert ff.utt_ids == GOOD and ff.num_classes == 12 and ff.norm_mean is None
    feats, labels = ff.read(0, ff.num_frames)
    want_feats, want_labels = expected(kaldi_dir, GOOD)
    np.testing.assert_array_equal(feats, want_feats)
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(ff.offsets, [0, 10, 17, 20])


def test_import_with_norm_and_num_classes(kaldi_dir: Path) -> None:
    out = kaldi_dir / "n.h5"
    import_kaldi(f"scp:{kaldi_dir / 'feats.scp'}", str(kaldi_dir / "ali.ark"), out,
                 num_classes=20)
    ff = FeatureFile(out)
    assert ff.num_classes == 20
    want, _ = expected(kaldi_dir, GOOD)
    np.testing.assert_allclose(ff.norm_mean, want.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ff.norm_std, want.std(0), rtol=1e-5)
    with h5py.File(out) as f:  # stored raw; normalised on read
        np.testing.assert_array_equal(f["feats"][()], want)


def test_import_errors(kaldi_dir: Path) -> None:
    scp, out = str(kaldi_dir / "feats.scp"), kaldi_dir / "bad.h5"
    with pytest.raises(ValueError, match="need at least 12"):
        import_kaldi(scp, str(kaldi_dir / "ali.ark"), out, num_classes=5)
    kaldiio.save_ark(str(kaldi_dir / "other.ark"), {"x": np.zeros(2, np.int32)})
    with pytest.raises(ValueError, match="no utterance .* could be imported"):
        import_kaldi(scp, str(kaldi_dir / "other.ark"), out)
    assert not out.exists()
    assert not [p for p in kaldi_dir.iterdir() if p.name.endswith(".tmp")]


def test_missing_kaldiio_message(kaldi_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kaldiio", None)  # makes "import kaldiio" fail
    with pytest.raises(ImportError, match=r"pip install 'hadpsgd\[kaldi\]'"):
        import_kaldi(str(kaldi_dir / "feats.scp"), "ali.ark", kaldi_dir / "x.h5")


def test_rspecifier() -> None:
    assert rspecifier("a/ali.ark") == "ark:a/ali.ark"
    assert rspecifier("a/ali.scp") == "scp:a/ali.scp"
    assert rspecifier("ark,t:ali.txt") == "ark,t:ali.txt"
    assert rspecifier("ark:gunzip -c ali.gz |") == "ark:gunzip -c ali.gz |"


def test_cli(kaldi_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = kaldi_dir / "cli.h5"
    assert main(["--feats-scp", str(kaldi_dir / "feats.scp"), "--alignments",
                 f"ark:{kaldi_dir / 'ali.ark'}", "--out", str(out), "--num-classes", "16",
                 "--no-norm"]) == 0
    printed = capsys.readouterr().out
    assert "3 utterances, 20 frames" in printed
    assert "skipped 1 (no alignment): spk2-noali" in printed
    assert "skipped 1 (length mismatch): spk2-short" in printed
    ff = FeatureFile(out)
    assert ff.num_classes == 16 and ff.norm_mean is None
    assert main(["--feats-scp", str(kaldi_dir / "feats.scp"), "--alignments",
                 str(kaldi_dir / "ali.ark"), "--out", str(out), "--num-classes", "3"]) == 2
    assert "at least 12" in capsys.readouterr().err


def test_heldout_like_train_shares_classes_and_normalisation(kaldi_dir: Path) -> None:
    """A held-out split whose pdf-ids happen to stop lower still gets the training set's class
    inventory, and is normalised with the training statistics, not its own."""
    rng = np.random.default_rng(1)
    dev = {"d1": (5.0 + rng.standard_normal((6, D))).astype(np.float32)}
    kaldiio.save_ark(str(kaldi_dir / "dev.ark"), dev, scp=str(kaldi_dir / "dev.scp"))
    kaldiio.save_ark(str(kaldi_dir / "devali.ark"), {"d1": np.array([0, 1, 2, 1, 0, 2],
                                                                    np.int32)})
    train = kaldi_dir / "train.h5"
    import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"), train)
    held = kaldi_dir / "heldout.h5"
    summary = import_kaldi(str(kaldi_dir / "dev.scp"), str(kaldi_dir / "devali.ark"), held,
                           like=train)
    tr, ho = FeatureFile(train), FeatureFile(held)
    assert ho.num_classes == tr.num_classes == 12  # not 3 from the held-out's own pdf-ids
    np.testing.assert_array_equal(ho.norm_mean, tr.norm_mean)
    np.testing.assert_array_equal(ho.norm_std, tr.norm_std)
    assert summary["norm"] == f"from {train}"
    feats, _ = ho.read(0, ho.num_frames)
    assert feats.mean() > 3.0  # the shift stays visible: not re-centred on its own mean
    with pytest.raises(ValueError, match="disagrees with"):
        import_kaldi(str(kaldi_dir / "dev.scp"), str(kaldi_dir / "devali.ark"),
                     kaldi_dir / "x.h5", like=train, num_classes=20)
    np.savez(kaldi_dir / "stats.npz", mean=np.ones(D, np.float32), std=np.full(D, 2, np.float32))
    import_kaldi(str(kaldi_dir / "dev.scp"), str(kaldi_dir / "devali.ark"), kaldi_dir / "n.h5",
                 norm_from=kaldi_dir / "stats.npz")
    assert FeatureFile(kaldi_dir / "n.h5").norm_std.tolist() == [2.0] * D


def test_pipeline_features_and_speaker_cmvn(kaldi_dir: Path) -> None:
    (kaldi_dir / "utt2spk").write_text("spk1-u1 spk1\nspk1-u2 spk1\nspk2-u3 spk2\n"
                                       "spk2-short spk2\n")
    out = kaldi_dir / "cmvn.h5"
    summary = import_kaldi(f"ark:cat {kaldi_dir / 'feats.ark'} |", str(kaldi_dir / "ali.ark"),
                           out, compute_norm=False, utt2spk=kaldi_dir / "utt2spk",
                           cmvn_vars=True)
    assert summary["utts"] == 3  # spk2-noali has no alignment, spk2-short a length mismatch
    ff = FeatureFile(out)
    feats, _ = ff.read(0, ff.num_frames)
    spk1 = feats[:17]  # spk1-u1 (10 frames) and spk1-u2 (7): one speaker's statistics
    np.testing.assert_allclose(spk1.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(spk1.std(0), 1.0, rtol=1e-4)
    # spk2's statistics include every utterance of spk2 in utt2spk, imported or not
    raw, _ = expected(kaldi_dir, ["spk2-u3"])
    assert not np.allclose(feats[17:], raw)


def test_info_tool(kaldi_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hadpsgd.data.__main__ import main as data_main

    out = kaldi_dir / "train.h5"
    import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"), out)
    assert data_main(["info", str(out), "--chunk-len", "5"]) == 0
    text = capsys.readouterr().out
    assert "3 utterances, 20 frames, feat_dim 5, 12 classes" in text
    assert "normalisation: mean in" in text and "training chunks of 5" in text
    assert data_main(["info", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    _, labels = expected(kaldi_dir, GOOD)
    assert sum(n for _, n in info["most_frequent"]) <= 20
    assert info["classes_without_frames"] == sorted(set(range(12)) - set(labels.tolist()))
    assert data_main(["info", str(kaldi_dir / "missing.h5")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_info_shows_the_import_record(kaldi_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CMVN and the class count's source: what the forward pass will redo on raw input."""
    from hadpsgd.data.__main__ import main as data_main

    (kaldi_dir / "utt2spk").write_text("spk1-u1 spk1\nspk1-u2 spk1\nspk2-u3 spk2\n"
                                       "spk2-short spk2\n")
    out = kaldi_dir / "cmvn.h5"
    import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"), out,
                 num_classes=12, utt2spk=kaldi_dir / "utt2spk", cmvn_vars=True)
    assert data_main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"import: hadpsgd.data.kaldi from {kaldi_dir / 'feats.scp'}" in text
    assert "CMVN: per-speaker CMVN (means and variances; statistics computed" in text
    assert f"utt2spk {kaldi_dir / 'utt2spk'}" in text and "classes: 12, from" in text
    assert data_main(["info", "--json", str(out)]) == 0
    record = json.loads(capsys.readouterr().out)["import"]
    assert record["cmvn"]["per"] == "speaker" and record["num_classes"] == 12
    assert record["classes_from"]
    # A file written by another tool has no record, and says so.
    plain = kaldi_dir / "plain.h5"
    write_features(plain, [np.zeros((4, 2), np.float32)], [np.zeros(4, np.int32)], ["u"],
                   num_classes=3)
    assert data_main(["info", str(plain)]) == 0
    assert "import: no record" in capsys.readouterr().out


def test_silence_classes_recorded_and_inherited(kaldi_dir: Path) -> None:
    train = kaldi_dir / "train.h5"
    assert main(["--feats", str(kaldi_dir / "feats.scp"), "--alignments",
                 str(kaldi_dir / "ali.ark"), "--out", str(train),
                 "--silence-classes", "0,1"]) == 0
    assert FeatureFile(train).silence_classes == (0, 1)
    held = kaldi_dir / "heldout.h5"
    import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"), held, like=train)
    assert FeatureFile(held).silence_classes == (0, 1)  # the training set's, by default
    with pytest.raises(ValueError, match=r"silence classes \[12\] are outside"):
        import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"),
                     kaldi_dir / "x.h5", silence_classes=[12])


def test_bad_alignments_are_a_user_error_naming_the_utterance(
        kaldi_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 (hadpsgd.exit_codes' user error), one line naming the utterance and the fix."""
    def run(ali: dict[str, np.ndarray]) -> str:
        kaldiio.save_ark(str(kaldi_dir / "bad.ark"), ali)
        out = kaldi_dir / "bad.h5"
        assert main(["--feats", str(kaldi_dir / "feats.scp"), "--alignments",
                     str(kaldi_dir / "bad.ark"), "--out", str(out)]) == 2
        assert not out.exists()
        err = capsys.readouterr().err
        assert err.startswith("python -m hadpsgd.data.kaldi: error: ") and err.count("\n") == 1
        return err

    negative = np.zeros(10, np.int32)
    negative[4] = -1
    err = run({"spk1-u1": negative})
    assert "utterance 'spk1-u1' has pdf-id -1 at frame 4" in err and "ali-to-pdf" in err
    err = run({"spk1-u1": np.zeros(9, np.int32)})  # every alignment one frame short
    assert "length mismatch: 1, e.g. 'spk1-u1' (10 feature frames, 9 alignment frames)" in err
    assert "belong to these features" in err
    assert main(["--feats", str(kaldi_dir / "feats.scp"), "--alignments",
                 str(kaldi_dir / "ali.ark"), "--out", str(kaldi_dir / "x.h5"),
                 "--num-classes", "11"]) == 2
    assert "utterance 'spk1-u2' has pdf-id 11 at frame 0" in capsys.readouterr().err
    assert main(["--feats", str(kaldi_dir / "missing.scp"), "--alignments",
                 str(kaldi_dir / "ali.ark"), "--out", str(kaldi_dir / "x.h5")]) == 2
    assert "missing.scp" in capsys.readouterr().err
