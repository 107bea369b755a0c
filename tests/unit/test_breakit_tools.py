"""A hostile user's inputs to the tools beside training: exit 2, one line naming the thing.

forward, export, decode, data (info), data.kaldi and plot, each fed a damaged or odd input
that used to end in a traceback (exit 1), a silent wrong result, or a file written elsewhere
than named. Every entry point is called in this process (``main(argv)``, or forward's
``setup`` on a fake one-learner topology: its ``main`` starts MPI).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from hadpsgd.data.__main__ import main as data_main
from hadpsgd.export.__main__ import main as export_main
from hadpsgd.forward import ForwardError
from hadpsgd.forward.__main__ import parser as forward_parser
from hadpsgd.forward.__main__ import setup as forward_setup
from hadpsgd.models import build_model
from hadpsgd.plot.__main__ import main as plot_main
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint
from tests.fakes import OneLearner

kaldiio = pytest.importorskip("kaldiio")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

DIM, CLASSES = 5, 3


def one_line_error(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    """The standard error of a refused command: exactly one line, the program's error."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert lines and lines[-1].startswith(f"{prog}: error: "), err
    return lines[-1]


def make_run(out: Path, edit: Any = None) -> Path:
    """A run directory with one checkpoint of a tiny BLSTM; ``edit(state)`` damages it."""
    torch.manual_seed(0)
    state: dict[str, Any] = {
        "model": build_model("tiny", DIM, CLASSES).state_dict(),
        "config": {"data": {"train": None, "chunk_len": 21}, "model": {"preset": "tiny"},
                   "train": {"precision": "fp32"}},
        "progress": {"epoch": 0, "step_in_epoch": 0, "global_step": 5}}
    if edit is not None:
        edit(state)
    save_checkpoint(state, checkpoint_path(out / "checkpoints", 5), meta={"step": 5})
    return out


def _set(path: tuple[str, ...], value: Any) -> Any:
    def edit(state: dict[str, Any]) -> None:
        where = state
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value
    return edit


def _nan_weights(state: dict[str, Any]) -> None:
    state["model"]["out.weight"].fill_(float("nan"))


@pytest.mark.parametrize(("edit", "says"), [
    (_set(("config", "data"), [1]), "config.data is [1]"),
    (_set(("config", "data", "chunk_len"), None), "config.data.chunk_len is None"),
    (_set(("config", "data", "train"), 7), "config.data.train is 7"),
    (_set(("config", "train"), "x"), "config.train is 'x'"),
    (_set(("model",), [1, 2]), "'model' entry is a list"),
    (_nan_weights, "non-finite weights (out.weight)"),
], ids=["data-list", "chunk-len-none", "train-int", "train-str", "weights-list", "nan"])
def test_a_damaged_checkpoint_is_refused_by_name(tmp_path: Path, edit: Any, says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Once a traceback (exit 1) or, for NaN weights, NaN scores written with exit 0."""
    run = make_run(tmp_path / "run", edit)
    out = tmp_path / "m.pt"
    assert export_main([str(run), "--out", str(out), "--norm", "none", "--priors", "none"]) == 2
    line = one_line_error(capsys, "hadpsgd.export")
    assert says in line and "step-00000005" in line and not out.exists()
    with pytest.raises(ForwardError, match="step-00000005"):  # forward reads it alike
        forward_setup(forward_parser().parse_args(
            ["--model", str(run), "--features", "x.h5", "--output", str(tmp_path / "o.h5")]),
            OneLearner())


@pytest.mark.parametrize("tolerance", ["nan", "-1", "inf"])
def test_export_refuses_a_tolerance_no_check_can_meet(tmp_path: Path, tolerance: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Once a full export and then exit 1 ("the exported model differs")."""
    with pytest.raises(SystemExit) as exc:
        export_main([str(tmp_path), "--out", str(tmp_path / "m.pt"), "--tolerance", tolerance])
    assert exc.value.code == 2
    assert "--tolerance: must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_directory_that_refuses_files_is_named_before_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/proc passes os.access for root; the write failed after the work, with a traceback."""
    run = make_run(tmp_path / "run")
    assert export_main([str(run), "--out", "/proc/m.pt", "--norm", "none"]) == 2
    assert "directory /proc is not writable" in one_line_error(capsys, "hadpsgd.export")
    with pytest.raises(ForwardError, match="directory /proc is not writable"):
        forward_setup(forward_parser().parse_args(
            ["--model", str(run), "--features", "x.h5", "--output", "/proc/o.h5"]),
            OneLearner())


@pytest.fixture
def kaldi_dir(tmp_path: Path) -> Path:
    """Features of 4 utterances (an ark and an scp with absolute paths) and alignments."""
    rng = np.random.default_rng(0)
    feats = {f"u{i}": rng.normal(size=(10, DIM)).astype(np.float32) for i in range(4)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats, scp=str(tmp_path / "feats.scp"))
    kaldiio.save_ark(str(tmp_path / "ali.ark"),
                     {u: (np.arange(10) % CLASSES).astype(np.int32) for u in feats})
    (tmp_path / "bad_offset.scp").write_text(f"u0 {tmp_path / 'feats.ark'}:999999\n")
    (tmp_path / "garbage.ark").write_bytes(b"\x00\x01garbage")
    return tmp_path


def test_forward_names_a_damaged_kaldi_table(kaldi_dir: Path) -> None:
    """An scp offset past its archive: kaldiio's bare AssertionError, once exit 1, no words."""
    run = make_run(kaldi_dir / "run")
    args = forward_parser().parse_args(
        ["--model", str(run), "--features", f"scp:{kaldi_dir / 'bad_offset.scp'}", "--output",
         str(kaldi_dir / "o.h5"), "--norm", "none"])
    with pytest.raises(ForwardError, match=r"--features scp:.*bad_offset.scp cannot be read"):
        forward_setup(args, OneLearner())


def _kaldi(kaldi_dir: Path, *flags: str, feats: str = "feats.scp", ali: str = "ali.ark",
           out: str = "out.h5") -> list[str]:
    return ["--feats", f"scp:{kaldi_dir / feats}" if feats.endswith(".scp") else
            f"ark:{kaldi_dir / feats}", "--alignments", f"ark:{kaldi_dir / ali}",
            "--out", str(kaldi_dir / out), *flags]


def test_data_kaldi_names_each_damaged_input(kaldi_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each once a traceback, or a message naming neither the flag nor the fix."""
    from hadpsgd.data.kaldi import main

    (kaldi_dir / "utt2spk.bin").write_bytes(b"\xff\xfe u0 s0\n")
    (kaldi_dir / "utt2spk.dup").write_text("u0 s0\nu0 s1\n")
    np.savez(kaldi_dir / "zero.npz", mean=np.zeros(DIM), std=np.zeros(DIM))
    (kaldi_dir / "cut.npz").write_bytes((kaldi_dir / "zero.npz").read_bytes()[:40])
    cases = [
        (_kaldi(kaldi_dir, ali="garbage.ark"), "--alignments ark:"),
        (_kaldi(kaldi_dir, feats="bad_offset.scp"), "--feats scp:"),
        (_kaldi(kaldi_dir, "--utt2spk", str(kaldi_dir / "utt2spk.bin")), "is not UTF-8 text"),
        (_kaldi(kaldi_dir, "--utt2spk", str(kaldi_dir / "utt2spk.dup")),
         "utterance 'u0' is given speaker 's1' after 's0'"),
        (_kaldi(kaldi_dir, "--norm-from", str(kaldi_dir / "zero.npz")), "'std' finite and > 0"),
        (_kaldi(kaldi_dir, "--norm-from", str(kaldi_dir / "cut.npz")), "not a readable .npz"),
        (_kaldi(kaldi_dir, out="."), "is a directory"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        assert says in one_line_error(capsys, "python -m hadpsgd.data.kaldi"), argv
    assert not (kaldi_dir / "out.h5").exists()
    with pytest.raises(SystemExit) as exc:
        main(_kaldi(kaldi_dir, "--num-pdfs", "0"))
    assert exc.value.code == 2 and "must be a whole number >= 1" in capsys.readouterr().err


def test_data_kaldi_refuses_an_existing_output_unless_overwrite(
        kaldi_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hadpsgd.data.kaldi import main

    assert main(_kaldi(kaldi_dir)) == 0
    before = (kaldi_dir / "out.h5").stat().st_mtime_ns
    assert main(_kaldi(kaldi_dir)) == 2
    line = one_line_error(capsys, "python -m hadpsgd.data.kaldi")
    assert "out.h5 already exists; pass --overwrite" in line
    assert (kaldi_dir / "out.h5").stat().st_mtime_ns == before
    assert main(_kaldi(kaldi_dir, "--overwrite")) == 0


def test_data_info_refuses_a_chunk_length_below_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Once ChunkDataset's ValueError as a traceback."""
    with pytest.raises(SystemExit) as exc:
        data_main(["info", str(tmp_path / "x.h5"), "--chunk-len", "0"])
    assert exc.value.code == 2 and "--chunk-len: must be a whole number >= 1" in \
        capsys.readouterr().err


def test_decode_names_each_damaged_input(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Non-UTF-8 text files (once tracebacks), inconsistent duration labels (once silently
    used), an infinite acoustic scale (once exit 0 with every utterance unfinished)."""
    from hadpsgd.decode.__main__ import NUM_CLASSES, main

    scores = {"spk-0-12": np.log(np.full((20, NUM_CLASSES), 1 / NUM_CLASSES, np.float32))}
    ark = tmp_path / "s.ark"
    kaldiio.save_ark(str(ark), scores)
    (tmp_path / "refs.txt").write_bytes(b"\xff\xfe spk-0-12 one\n")
    (tmp_path / "words.txt").write_bytes(b"\xff\xfe\n")
    (tmp_path / "g.fst").write_bytes(b"x")
    with h5py.File(tmp_path / "dur.h5", "w") as h5:
        h5["labels"], h5["offsets"] = np.array([1, 2, 3]), np.array([5, 1])
    cases = [
        (["--refs", str(tmp_path / "refs.txt")], "reference file"),
        (["--graph", str(tmp_path / "g.fst"), "--words", str(tmp_path / "words.txt")],
         "--words"),
        (["--durations-from", str(tmp_path / "dur.h5")], "offsets run from 0"),
    ]
    for flags, says in cases:
        assert main([f"ark:{ark}", *flags]) == 2, flags
        line = one_line_error(capsys, "python -m hadpsgd.decode")
        assert says in line and str(tmp_path) in line, line
    for flag in ("--acoustic-scale", "--beam"):
        with pytest.raises(SystemExit) as exc:
            main([f"ark:{ark}", flag, "inf"])
        assert exc.value.code == 2 and "must be positive and finite" in capsys.readouterr().err


def test_decode_refuses_an_existing_output_and_writes_it_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--hyps / --json already there: refused by name unless --overwrite; written under a
    temporary name and renamed (no temporary left beside it)."""
    from hadpsgd.decode.__main__ import NUM_CLASSES, main

    ark = tmp_path / "s.ark"
    kaldiio.save_ark(str(ark), {"spk-0-12": np.log(np.full((20, NUM_CLASSES), 1 / NUM_CLASSES,
                                                           np.float32))})
    hyps, report = tmp_path / "hyp.txt", tmp_path / "wer.json"
    assert main([f"ark:{ark}", "--hyps", str(hyps), "--json", str(report)]) == 0
    assert hyps.read_text().startswith("spk-0-12") and json.loads(report.read_text())
    capsys.readouterr()
    for flag, path in (("--hyps", hyps), ("--json", report)):
        assert main([f"ark:{ark}", flag, str(path)]) == 2
        line = one_line_error(capsys, "python -m hadpsgd.decode")
        assert f"{flag} {path} already exists; pass --overwrite" in line
    assert main([f"ark:{ark}", "--hyps", str(hyps), "--json", str(report), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyp.txt", "s.ark", "wer.json"]


def _run_dir(tmp_path: Path, text: bytes) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(text)
    return run


@pytest.mark.parametrize(("text", "says"), [
    (b'[1, 2]\n{"kind": "train", "step": 1, "loss": 2.0}\n', "not a JSON object"),
    (b"\xff\xfe\n", "is not UTF-8 text"),
], ids=["json-list", "binary"])
def test_plot_names_a_damaged_metrics_file(tmp_path: Path, text: bytes, says: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Once an AttributeError traceback, and a decode error naming no file."""
    run = _run_dir(tmp_path, text)
    assert plot_main([str(run)]) == 2
    line = one_line_error(capsys, "hadpsgd.plot")
    assert says in line and "metrics.jsonl" in line


def test_plot_writes_the_file_it_names_or_refuses(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Without a suffix (or naming a directory) matplotlib wrote NAME.png and the command
    printed NAME; the figure is now written whole under a temporary name, then renamed."""
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path, b"".join(json.dumps({"kind": "train", "step": s, "loss": 1.0 / s})
                                      .encode() + b"\n" for s in (1, 2)))
    for out in (tmp_path / "fig", tmp_path):
        assert plot_main([str(run), "--out", str(out)]) == 2
        assert str(out) in one_line_error(capsys, "hadpsgd.plot")
    assert not (tmp_path / "fig.png").exists() and not Path(f"{tmp_path}.png").exists()
    assert plot_main([str(run), "--out", str(tmp_path / "fig.svg")]) == 0
    assert (tmp_path / "fig.svg").read_text().lstrip().startswith("<?xml")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
