"""python -m hadpsgd.export: both formats equal hadpsgd.forward on raw features; the check bites."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hadpsgd.data import PRIORS_FILE, FeatureFile, priors_of, save_priors
from hadpsgd.export.__main__ import main
from hadpsgd.export.formats import EXTRA_FILE
from hadpsgd.export.graph import Deployable
from hadpsgd.models import build_model
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint
from tests.unit.test_forward import forward

# torch 2.9+ marks torch.jit deprecated; the tests load the file as a user would still.
pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning"),
              pytest.mark.usefixtures("one_torch_thread")]




@pytest.fixture(scope="module")
def run_dir(tiny_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of two checkpoints of a two-layer BLSTM (random weights), with its priors."""
    run = tmp_path_factory.mktemp("run")
    config = {"data": {"train": str(tiny_data[0]), "chunk_len": 21},
              "model": {"preset": "small", "lstm_layout": "auto"}, "train": {"precision": "fp32"}}
    for step in (5, 10):
        torch.manual_seed(step)
        state = {"model": build_model("small", 260, 12).state_dict(), "config": config,
                 "progress": {"epoch": 0, "step_in_epoch": 0, "global_step": step}}
        save_checkpoint(state, checkpoint_path(run / "checkpoints", step), meta={"step": step})
    save_priors(priors_of(tiny_data[0]), run / PRIORS_FILE)
    return run


@pytest.fixture(scope="module")
def forwarded(run_dir: Path, tiny_data: tuple[Path, Path],
              tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """hadpsgd.forward's pseudo-log-likelihoods of the first held-out utterance (--avg 2)."""
    out = tmp_path_factory.mktemp("fw") / "ll.h5"
    forward("--model", run_dir, "--avg", "2", "--features", tiny_data[1], "--output", out)
    with h5py.File(out, "r") as h5:
        assert h5.attrs["kind"] == "pseudo-log-likelihoods"
        return h5["loglikes"][: int(h5["offsets"][1])]


def raw_utterance(heldout: Path) -> np.ndarray:
    """The first held-out utterance as stored: not normalised (what a user has)."""
    ff = FeatureFile(heldout)
    return ff.feats_dataset[int(ff.offsets[0]):int(ff.offsets[1])].astype(np.float32)


def export(*argv: str | Path) -> int:
    return main([str(a) for a in argv])


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_the_exported_model_on_raw_features_equals_forward(
        fmt: str, run_dir: Path, tiny_data: tuple[Path, Path], forwarded: np.ndarray,
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if fmt == "onnx":
        ort = pytest.importorskip("onnxruntime")
    out = tmp_path / ("model.onnx" if fmt == "onnx" else "model.pt")
    assert export(run_dir, "--avg", "2", "--format", fmt, "--out", out) == 0
    printed = capsys.readouterr().out
    assert "batch 1 x 37 frames: max |diff|" in printed and "batch 3 x 123 frames" in printed
    assert "average of 2 checkpoints" in printed and "baked in" in printed
    feats = raw_utterance(tiny_data[1])[None]
    if fmt == "onnx":
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        assert [o.name for o in session.get_outputs()] == ["log_likelihoods"]
        got = session.run(None, {"features": feats})[0][0]
        described = session.get_modelmeta().custom_metadata_map
    else:
        extra = {EXTRA_FILE: ""}
        module = torch.jit.load(str(out), _extra_files=extra)
        with torch.no_grad():
            got = module(torch.from_numpy(feats))[0].numpy()
        described = json.loads(extra[EXTRA_FILE])
    assert described["model"].startswith("average of 2 checkpoints")
    np.testing.assert_allclose(got, forwarded, rtol=0, atol=1e-4)


def test_a_prior_scale_is_baked_in_as_forward_applies_it(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "ll.h5",
            "--prior-scale", "0.4")
    with h5py.File(tmp_path / "ll.h5", "r") as h5:
        expected = h5["loglikes"][: int(h5["offsets"][1])]
    out = tmp_path / "model.pt"
    assert export(run_dir, "--out", out, "--prior-scale", "0.4") == 0
    module = torch.jit.load(str(out), _extra_files={EXTRA_FILE: ""})
    with torch.no_grad():
        got = module(torch.from_numpy(raw_utterance(tiny_data[1])[None]))[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_a_wrong_export_fails_the_check_and_writes_nothing(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    class Off(Deployable):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            with torch.no_grad():
                self.out.bias[0] += 0.05

    monkeypatch.setattr("hadpsgd.export.__main__.Deployable", Off)
    out = tmp_path / "model.pt"
    assert export(run_dir, "--out", out) == 1
    err = capsys.readouterr().err
    assert "max abs difference" in err and "> tolerance 0.001" in err and "not written" in err
    assert list(tmp_path.iterdir()) == []


def test_onnx_without_onnxruntime_says_how_to_install(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime fails
    assert export(run_dir, "--out", tmp_path / "m.onnx") == 2
    err = capsys.readouterr().err
    assert "needs onnxruntime" in err and "pip install 'hadpsgd[export]'" in err


@pytest.mark.parametrize("argv,named", [
    (["--out", "{tmp}/m.bin"], "--format torchscript or --format onnx"),
    (["--out", "{tmp}/there.pt"], "already exists; pass --overwrite"),
    (["--out", "{tmp}/m.pt", "--avg", "3"], "has 2 complete checkpoints"),
    (["--out", "{tmp}/m.pt", "--norm", "{tmp}/none.h5"], "--norm {tmp}/none.h5"),
    (["--out", "{tmp}/m.pt", "--prior-scale", "-1"], "--prior-scale -1: the priors' exponent"),
    (["--out", "{tmp}/m.pt", "--priors", "none", "--prior-scale", "0.5"],
     "--prior-scale 0.5 without priors"),
])
def test_user_errors_are_one_line_and_exit_2(run_dir: Path, tmp_path: Path, argv: list[str],
                                             named: str, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "there.pt").write_bytes(b"")
    assert export(run_dir, *[a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert named.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1


def test_norm_none_takes_normalised_features_and_priors_none_log_posteriors(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    assert export(run_dir, "--out", out, "--norm", "none", "--priors", "none") == 0
    # forward's older spelling is read here too: the model as --model, the file as --output.
    again = tmp_path / "again.pt"
    assert export("--model", run_dir, "--output", again, "--norm", "none", "--priors",
                  "none") == 0 and again.is_file()
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "p.h5",
            "--priors", "none")
    ff = FeatureFile(tiny_data[1])
    feats = torch.from_numpy(ff.read(int(ff.offsets[0]), int(ff.offsets[1]))[0])[None]
    with torch.no_grad():
        got = torch.jit.load(str(out))(feats)[0].numpy()
    with h5py.File(tmp_path / "p.h5", "r") as h5:
        want = h5["loglikes"][: int(h5["offsets"][1])]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_the_imports_cmvn_is_named_as_left_to_the_user(tiny_data: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    from hadpsgd.data.pipeline import CmvnRecord, ImportRecord, read_record
    from hadpsgd.export.inputs import cmvn_note

    assert cmvn_note(tiny_data[0]) == ""  # no import record: nothing left to the user
    train = tmp_path / "train.h5"
    train.write_bytes(tiny_data[0].read_bytes())
    record = ImportRecord(features="scp:feats.scp", alignments="ark:ali.ark",
                          cmvn=CmvnRecord("speaker", True, utt2spk="utt2spk"), norm="computed",
                          num_classes=12, classes_from="alignments")
    with h5py.File(train, "a") as h5:
        h5.attrs["pipeline"] = record.to_json()
    assert read_record(train) == record
    note = cmvn_note(train)
    assert "per-speaker CMVN (means and variances" in note and "not in the graph" in note
