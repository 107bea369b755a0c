"""``lab.sweep --wer`` end to end: a cell trained, then scored through hadpsgd.forward and
hadpsgd.decode on its held-out speakers; a cell trained before ``--wer`` scored without
training again; ``lab.studies.scale_wer`` reads the folds' rows (issue 46)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from examples.digits import fsdd
from tests._mpi import ROOT

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def fold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fold built by examples/digits/fsdd.py from tones named as FSDD's recordings."""
    root = tmp_path_factory.mktemp("fsdd")
    rec = root / "recordings"
    rec.mkdir()
    t = np.arange(2400) / fsdd.RATE
    for speaker in fsdd.SPEAKERS:
        for digit in (1, 4):
            for take in range(3):
                word = 0.5 * np.sin(2 * np.pi * (300 + 90 * digit + 7 * take) * t)
                x = np.concatenate([np.zeros(800), word, np.zeros(800)])
                with wave.open(str(rec / f"{digit}_{speaker}_{take}.wav"), "wb") as w:
                    w.setnchannels(1)
                    w.setsampwidth(2)
                    w.setframerate(fsdd.RATE)
                    w.writeframes((x * 20000).astype("<i2").tobytes())
    assert fsdd.main([str(rec), str(root / "spA"), "--fold", "A"]) == 0
    return root / "spA"


def _sweep(sweep_dir: Path, data: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lab.sweep", "--sweep-dir", str(sweep_dir), "--algos", "ssgd",
           "--global-batch", "4", "--learners", "1", "--epochs", "1", "--preset", "tiny",
           "--seed", "0", "--timeout", "600", *flags, "--",
           "--train", str(data / "train.h5"), "--heldout", str(data / "heldout.h5"),
           "--max-steps", "6", "--log-every", "2"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, HADPSGD_TIMEOUT="300"))


def _rows(sweep_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (sweep_dir / "results.jsonl").read_text().splitlines()]


def test_a_cell_is_scored_in_words_and_an_older_cell_without_training_again(tmp_path: Path,
                                                                            fold: Path) -> None:
    sweep = tmp_path / "study" / "foldA"
    first = _sweep(sweep, fold)  # trained, not scored
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (row,) = _rows(sweep)
    assert row["status"] == "ok" and "wer" not in row
    cell = Path(row["out_dir"])
    trained = (cell / "metrics.jsonl").stat().st_mtime_ns

    again = _sweep(sweep, fold, "--wer")  # finished before --wer: scored, not retrained
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = _rows(sweep)
    assert len(rows) == 2 and rows[-1]["id"] == row["id"]
    assert (cell / "metrics.jsonl").stat().st_mtime_ns == trained
    scored = rows[-1]
    report = json.loads((cell / "wer.json").read_text())["score"]
    assert scored["wer"] == report["wer"] and 0 <= scored["wer"] <= 100 + 1e-9
    assert scored["wer_words"] == report["ref_words"] == 12  # 2 held-out speakers x 6 words
    assert not (cell / "loglikes.h5").exists()

    table = subprocess.run([sys.executable, "-m", "lab.studies.scale_wer", str(tmp_path / "study"),
                            "--json", str(tmp_path / "t.json")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert table.returncode == 0, table.stderr
    assert "ssgd N1 B4 adam" not in table.stdout and "ssgd N1 B4 sgd" in table.stdout
    rec = json.loads((tmp_path / "t.json").read_text())
    assert rec["rows"][0]["fold"] == "spA" and rec["rows"][0]["wer"] == scored["wer"]


def test_wer_needs_the_heldout_and_train_sets(tmp_path: Path) -> None:
    from lab.sweep.score import score_row

    row = {"status": "ok", "out_dir": str(tmp_path)}
    assert "--train" in score_row(row, ["--heldout", "h.h5"])["wer_error"]
    assert score_row({"status": "failed"}, []) == {"status": "failed"}
