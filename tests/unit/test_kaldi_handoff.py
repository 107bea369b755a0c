"""The Kaldi hand-off: the import records its transformations, the forward pass redoes or refuses.

A small synthetic Kaldi data directory (three speakers, each with its own offset, written with
kaldiio; no Kaldi binaries): imported with per-speaker CMVN, then forwarded from the raw
``feats.scp``: refused without ``--utt2spk``, and with it the very frames of the import.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

kaldiio = pytest.importorskip("kaldiio")

from hadpsgd.data import FeatureFile  # noqa: E402
from hadpsgd.data.cmvn import apply_cmvn  # noqa: E402
from hadpsgd.data.kaldi import import_kaldi, main  # noqa: E402
from hadpsgd.data.pdfs import parse_num_pdfs  # noqa: E402
from hadpsgd.data.pipeline import cmvn_mismatch, read_record  # noqa: E402
from hadpsgd.forward import ForwardError  # noqa: E402
from hadpsgd.forward.__main__ import parser, setup  # noqa: E402
from hadpsgd.forward.job import run  # noqa: E402
from hadpsgd.models import build_model  # noqa: E402
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint  # noqa: E402
from tests.fakes import OneLearner  # noqa: E402

D, PDFS = 6, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def kaldi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """feats.{ark,scp}, utt2spk, cmvn.scp (per speaker, Kaldi's layout), ali.ark, tree-info."""
    out = tmp_path_factory.mktemp("kaldi")
    rng = np.random.default_rng(0)
    feats, ali, utt2spk, stats = {}, {}, [], {}
    for s in range(3):
        shift, scale = rng.normal(0, 5, D), rng.uniform(0.5, 3, D)
        spk = f"spk{s}"
        for u in range(3):
            utt = f"{spk}-u{u}"
            feats[utt] = (shift + scale * rng.standard_normal((30 + 7 * u, D))).astype(np.float32)
            ali[utt] = rng.integers(0, PDFS - 2, len(feats[utt])).astype(np.int32)
            utt2spk.append(f"{utt} {spk}")
        x = np.concatenate([feats[f"{spk}-u{u}"] for u in range(3)]).astype(np.float64)
        # compute-cmvn-stats' layout: sums and the count in row 0, squares in row 1.
        stats[spk] = np.vstack([np.append(x.sum(0), len(x)), np.append((x * x).sum(0), 0)])
    with kaldiio.WriteHelper(f"ark,scp:{out / 'feats.ark'},{out / 'feats.scp'}") as writer:
        for utt, mat in feats.items():
            writer(utt, mat)
    kaldiio.save_ark(str(out / "cmvn.ark"), stats, scp=str(out / "cmvn.scp"))
    kaldiio.save_ark(str(out / "ali.ark"), ali)
    (out / "utt2spk").write_text("\n".join(utt2spk) + "\n")
    (out / "tree-info.txt").write_text(f"num-pdfs {PDFS}\ncontext-width 3\ncentral-position 1\n")
    return out


def imported(kaldi_dir: Path, name: str, *flags: str) -> Path:
    out = kaldi_dir / name
    if not out.exists():
        assert main(["--feats", str(kaldi_dir / "feats.scp"), "--alignments",
                     str(kaldi_dir / "ali.ark"), "--tree-info", str(kaldi_dir / "tree-info.txt"),
                     "--out", str(out), *flags]) == 0
    return out


def make_run(out: Path, train: Path) -> Path:
    """A run directory with one checkpoint of a tiny BLSTM trained (by name) on ``train``."""
    torch.manual_seed(0)
    config = {"data": {"train": str(train), "chunk_len": 21},
              "model": {"preset": "tiny", "lstm_layout": "auto"}, "train": {"precision": "fp32"}}
    state = {"model": build_model("tiny", D, PDFS).state_dict(), "config": config,
             "progress": {"epoch": 0, "step_in_epoch": 0, "global_step": 1}}
    save_checkpoint(state, checkpoint_path(out / "checkpoints", 1), meta={"step": 1})
    return out


def forward(*argv: str | Path) -> None:
    topo = OneLearner()
    run(topo, setup(parser().parse_args([str(a) for a in argv] + ["--no-progress"]), topo))


def frames_of(spec: str, train: Path, *flags: str) -> tuple[np.ndarray, list[str]]:
    """What the forward pass feeds the model for ``--features spec`` (opened as it does)."""
    args = parser().parse_args(["--model", "x", "--features", spec, "--output", "o.h5", *flags])
    from hadpsgd.forward.features import open_features

    features, _ = open_features(args.features, args.norm, str(train), args.utt2spk, args.cmvn)
    if hasattr(features, "peek_dim"):
        features.peek_dim()
    pairs = list(features.read())
    return np.concatenate([m for _, m in pairs]), [u for u, _ in pairs]


def test_the_import_records_every_transformation(kaldi_dir: Path) -> None:
    train = imported(kaldi_dir, "train.h5", "--utt2spk", str(kaldi_dir / "utt2spk"))
    record = read_record(train)
    assert record is not None and record.cmvn is not None
    assert (record.cmvn.per, record.cmvn.norm_vars, record.cmvn.stats) == ("speaker", False,
                                                                         "computed")
    assert record.cmvn.utt2spk == str(kaldi_dir / "utt2spk")
    assert record.norm == "computed on these frames"
    assert record.num_classes == FeatureFile(train).num_classes == PDFS  # not the largest id + 1
    assert "tree-info" in record.classes_from
    with h5py.File(train) as h5:
        assert json.loads(h5.attrs["pipeline"])["format"] == "hadpsgd-pipeline/1"


def test_forward_redoes_the_speakers_cmvn_or_refuses(kaldi_dir: Path, tmp_path: Path) -> None:
    train = imported(kaldi_dir, "train.h5", "--utt2spk", str(kaldi_dir / "utt2spk"))
    run_dir = make_run(tmp_path / "run", train)
    raw = f"scp:{kaldi_dir / 'feats.scp'}"
    with pytest.raises(ForwardError, match=r"per-speaker CMVN.*pass --utt2spk"):
        forward("--model", run_dir, "--features", raw, "--output", tmp_path / "x.h5")
    # With the speakers: the very frames the import wrote (norm/ applied as the reader does).
    ff = FeatureFile(train)
    got, ids = frames_of(raw, train, "--utt2spk", str(kaldi_dir / "utt2spk"))
    assert ids == ff.utt_ids and np.array_equal(got, ff.read(0, ff.num_frames)[0])
    # Kaldi's own statistics (compute-cmvn-stats' layout) give the same, to float rounding.
    kaldi, _ = frames_of(raw, train, "--utt2spk", str(kaldi_dir / "utt2spk"),
                         "--cmvn", f"scp:{kaldi_dir / 'cmvn.scp'}")
    np.testing.assert_allclose(kaldi, got, rtol=0, atol=1e-4)
    # The whole command: the scores of the raw table equal those of the imported file.
    forward("--model", run_dir, "--features", raw, "--utt2spk", kaldi_dir / "utt2spk",
            "--output", tmp_path / "raw.h5", "--priors", "none")
    forward("--model", run_dir, "--features", train, "--output", tmp_path / "h5.h5",
            "--priors", "none")
    with h5py.File(tmp_path / "raw.h5") as a, h5py.File(tmp_path / "h5.h5") as b:
        np.testing.assert_allclose(a["loglikes"][()], b["loglikes"][()], rtol=0, atol=1e-5)


def test_forward_refuses_what_the_record_does_not_ask_for(kaldi_dir: Path) -> None:
    plain = imported(kaldi_dir, "plain.h5")
    raw = f"scp:{kaldi_dir / 'feats.scp'}"
    with pytest.raises(ForwardError, match="imported without CMVN.*drop --utt2spk"):
        frames_of(raw, plain, "--utt2spk", str(kaldi_dir / "utt2spk"))
    per_utt = imported(kaldi_dir, "per_utt.h5", "--cmvn-per-utt", "--cmvn-vars")
    with pytest.raises(ForwardError, match="not per speaker; drop --utt2spk"):
        frames_of(raw, per_utt, "--utt2spk", str(kaldi_dir / "utt2spk"))
    got, _ = frames_of(raw, per_utt)  # per utterance: nothing to pass, redone as imported
    ff = FeatureFile(per_utt)
    assert np.array_equal(got, ff.read(0, ff.num_frames)[0])
    # An .h5 input imported without the training file's CMVN is refused by name.
    train = imported(kaldi_dir, "train.h5", "--utt2spk", str(kaldi_dir / "utt2spk"))
    with pytest.raises(ForwardError, match=r"plain.h5 was imported with no CMVN.*--utt2spk"):
        frames_of(str(plain), train)
    assert cmvn_mismatch(train, plain) is not None and cmvn_mismatch(train, train) is None


def test_a_heldout_split_like_train_must_share_its_cmvn(kaldi_dir: Path) -> None:
    train = imported(kaldi_dir, "train.h5", "--utt2spk", str(kaldi_dir / "utt2spk"))
    with pytest.raises(ValueError, match=r"--like .* per-speaker CMVN.*--utt2spk UTT2SPK"):
        import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"),
                     kaldi_dir / "dev.h5", like=train)
    import_kaldi(str(kaldi_dir / "feats.scp"), str(kaldi_dir / "ali.ark"), kaldi_dir / "dev.h5",
                 like=train, utt2spk=kaldi_dir / "utt2spk",
                 cmvn_stats=f"scp:{kaldi_dir / 'cmvn.scp'}")  # Kaldi's statistics: same CMVN
    assert cmvn_mismatch(train, kaldi_dir / "dev.h5") is None
    # Training refuses a held-out file imported with another CMVN before anything is built.
    from hadpsgd.assembly.data import load_data
    from hadpsgd.config import parse_config
    from hadpsgd.data import FeatureFileError

    plain = imported(kaldi_dir, "plain.h5")
    cfg = parse_config(["--train", str(train), "--heldout", str(plain), "--batch-size", "1",
                        "--chunk-len", "5"])
    with pytest.raises(FeatureFileError, match="plain.h5 was imported with no CMVN"):
        load_data(cfg, OneLearner())  # type: ignore[arg-type]


def test_apply_cmvn_is_kaldis() -> None:
    rng = np.random.default_rng(1)
    x = (3 + 2 * rng.standard_normal((50, 4))).astype(np.float32)
    x[:, 3] = 7.0  # a constant dimension is only centred
    stats = np.vstack([np.append(x.sum(0, dtype=np.float64), 50),
                       np.append((x.astype(np.float64) ** 2).sum(0), 0)])
    np.testing.assert_allclose(apply_cmvn(stats, x, False), x - x.mean(0), atol=1e-5)
    want = (x - x.mean(0)) / np.where(x.std(0) > 0, x.std(0), 1)
    np.testing.assert_allclose(apply_cmvn(stats, x, True), want, atol=1e-4)


def test_num_pdfs_from_kaldis_text_and_ids_beyond_it(kaldi_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_num_pdfs("num-pdfs 1928\ncontext-width 3\ncentral-position 1\n", "t") == 1928
    assert parse_num_pdfs("number of phones 48\nnumber of pdfs 1928\n", "am-info") == 1928
    with pytest.raises(ValueError, match="no 'num-pdfs N' line.*tree-info exp/tri3/tree"):
        parse_num_pdfs("number of phones 48\n", "x")
    (kaldi_dir / "small-tree.txt").write_text("num-pdfs 3\n")
    assert main(["--feats", str(kaldi_dir / "feats.scp"), "--alignments",
                 str(kaldi_dir / "ali.ark"), "--tree-info", str(kaldi_dir / "small-tree.txt"),
                 "--out", str(kaldi_dir / "bad.h5")]) == 2
    err = capsys.readouterr().err
    assert "utterance 'spk0-u0' has pdf-id" in err and "small-tree.txt (num-pdfs 3)" in err
    assert not (kaldi_dir / "bad.h5").exists()
    assert main(["--feats", str(kaldi_dir / "feats.scp"), "--alignments",
                 str(kaldi_dir / "ali.ark"), "--num-pdfs", "9", "--tree-info",
                 str(kaldi_dir / "tree-info.txt"), "--out", str(kaldi_dir / "bad.h5")]) == 2
    assert "--num-pdfs 9 disagrees with --tree-info" in capsys.readouterr().err


def test_a_kaldi_output_says_what_it_holds(kaldi_dir: Path, tmp_path: Path) -> None:
    from hadpsgd.decode.loglikes import LoglikesReader

    train = imported(kaldi_dir, "train.h5", "--utt2spk", str(kaldi_dir / "utt2spk"))
    run_dir = make_run(tmp_path / "run", train)
    ark, scp = tmp_path / "o.ark", tmp_path / "o.scp"
    forward("--model", run_dir, "--features", train, "--priors", train,
            "--output", f"ark,scp:{ark},{scp}")
    side = json.loads((tmp_path / "o.scp.json").read_text())
    assert side["kind"] == "pseudo-log-likelihoods" and side["num_classes"] == PDFS
    for source in (f"scp:{scp}", f"ark:{ark}", f"ark,scp:{ark},{scp}"):
        reader = LoglikesReader(source, None)
        assert reader.kind == "pseudo-log-likelihoods"
        assert len(list(reader)) == 9 and reader.num_classes == PDFS
    with open(ark, "ab") as grown:  # written again by another tool: the sidecar is stale
        grown.write(b"x")
    assert LoglikesReader(f"ark:{ark}", None).kind is None
