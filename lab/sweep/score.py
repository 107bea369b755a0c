"""Word error rate of a finished cell: ``hadpsgd.forward`` then ``hadpsgd.decode`` (``--wer``).

A model is judged by its WER on speakers it never heard, not by its frame accuracy
(docs/results.md): with ``--wer`` every cell that finishes ``ok`` is scored on its own
``--heldout`` set, as a user scores a model, through the user's two commands:

    python -m hadpsgd.forward OUT --features HELDOUT --priors TRAIN --out OUT/loglikes.h5
    python -m hadpsgd.decode OUT/loglikes.h5 --json OUT/wer.json

(pseudo-log-likelihoods: the posteriors over the training set's label priors, as a hybrid
system decodes). The row gains ``wer`` and ``ser`` (percent), or ``wer_error`` saying which
step failed; a cell trained before ``--wer`` is scored without training again
(``lab.sweep``'s ``run_all``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import bench_env, flag_value

WER_JSON = "wer.json"
"""The decode's report in the cell's directory."""


def data_of(extra: Sequence[str]) -> tuple[str, str] | None:
    """``(heldout, train)`` from a cell's passthrough, or None when either is missing."""
    heldout, train = flag_value(extra, "--heldout"), flag_value(extra, "--train")
    return (heldout, train) if heldout and train else None


def score(out_dir: Path, heldout: str, train: str, timeout: float = 1800.0) -> dict[str, Any]:
    """Forward the cell's model over ``heldout`` and decode; ``{"wer": .., "ser": ..}``.

    On a failure ``{"wer": None, "wer_error": why}``, the step named, its log beside the run.
    """
    loglikes = out_dir / "loglikes.h5"
    report = out_dir / WER_JSON
    steps = [
        ("forward", [sys.executable, "-m", "hadpsgd.forward", str(out_dir), "--features",
                     heldout, "--priors", train, "--out", str(loglikes), "--overwrite"]),
        ("decode", [sys.executable, "-m", "hadpsgd.decode", str(loglikes), "--json",
                    str(report), "--overwrite"]),
    ]
    log = out_dir / "score.log"
    with log.open("wb") as fh:
        for name, cmd in steps:
            try:
                code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                      env=bench_env(1), timeout=timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                return {"wer": None, "wer_error": f"{name} timed out after {timeout:g} s; "
                                                  f"see {log}"}
            if code != 0:
                return {"wer": None, "wer_error": f"{name} exited {code}; see {log}"}
    result = json.loads(report.read_text())["score"] or {}
    loglikes.unlink(missing_ok=True)  # large, and remade on demand
    return {"wer": result.get("wer"), "ser": result.get("ser"),
            "wer_words": result.get("ref_words")}


def score_row(row: dict[str, Any], extra: Sequence[str]) -> dict[str, Any]:
    """``row`` with its WER, where the cell finished ``ok`` and its data are known."""
    if row.get("status") != "ok":
        return row
    data = data_of(extra)
    if data is None:
        return {**row, "wer": None,
                "wer_error": "--wer needs --train and --heldout in the hadpsgd.run arguments"}
    return {**row, **score(Path(row["out_dir"]), *data)}
