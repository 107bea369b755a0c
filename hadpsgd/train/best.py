"""The best checkpoints by held-out score: which ones pruning spares, and ``best.json``.

A checkpoint written right after a held-out evaluation of its own step (the end of an epoch,
the end of the run) records that evaluation in its manifest: ``MANIFEST.json``'s ``heldout``
entry (``loss``, ``accuracy``, ``frames``, ``speech_accuracy``, ``speech_frames``, the fields
of :class:`hadpsgd.train.evaluate.EvalResult`). One written between evaluations (at a
``--checkpoint-every`` boundary, on a stop request) records none and is never among the best.

Best is the lowest held-out loss; of two equal losses, the newer checkpoint. ``--keep-best K``
spares the K best from ``--keep-checkpoints``' pruning of the older ones, and
``checkpoints/best.json`` lists every checkpoint on disk that has a score, best first, with
the K marked (``"best": true``), for people and for tools that pick or average the best N.
The manifests are the record (checksummed with the checkpoint); ``best.json`` is an index of
them, rewritten atomically after every checkpoint.

This module reads and writes no checkpoint itself (:mod:`hadpsgd.train.checkpoint` hands it
the manifests), so the checkpoint module may use it without an import circle.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCORE_KEY = "heldout"
"""The manifest field with the held-out evaluation of the checkpoint's step."""
BEST_FILE = "best.json"
"""The index of the scored checkpoints, in the checkpoints directory."""
FORMAT = "hadpsgd-best/1"


def heldout_loss(manifest: dict[str, Any]) -> float | None:
    """The held-out loss a checkpoint's manifest records, or None where it has no score."""
    score = manifest.get(SCORE_KEY)
    loss = score.get("loss") if isinstance(score, dict) else None
    if isinstance(loss, bool) or not isinstance(loss, int | float) or not math.isfinite(loss):
        return None  # a non-finite loss is a diverged model: never among the best
    return float(loss)


def rank(found: Sequence[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """The scored checkpoints of ``found`` ((path, manifest), oldest first), best first.

    Best is the lowest held-out loss; of a tie, the newer checkpoint.
    """
    scored = [(i, p, m) for i, (p, m) in enumerate(found) if heldout_loss(m) is not None]
    scored.sort(key=lambda ipm: (heldout_loss(ipm[2]), -ipm[0]))
    return [(p, m) for _, p, m in scored]


def write_best(ckpt_dir: Path, ranked: Sequence[tuple[Path, dict[str, Any]]],
               keep_best: int) -> Path:
    """Write ``best.json`` in ``ckpt_dir`` atomically: ``ranked`` (best first), K marked.

    Written to a temporary file, fsynced and renamed over the old one (then the directory
    fsynced), as the checkpoints are: a reader sees the old index or the new, never half.

    Args:
        ckpt_dir: The checkpoints directory.
        ranked: The scored checkpoints on disk, best first (:func:`rank`).
        keep_best: ``--keep-best``: how many of the first are spared from pruning.

    Returns:
        The path of ``best.json``.
    """
    entries = []
    for i, (path, manifest) in enumerate(ranked):
        score = manifest[SCORE_KEY]
        entries.append({"name": path.name, "step": manifest.get("step"),
                        "heldout_loss": heldout_loss(manifest),
                        "heldout_acc": score.get("accuracy"), "best": i < keep_best})
    doc = {"format": FORMAT, "metric": "heldout_loss", "lower_is_better": True,
           "keep_best": keep_best, "checkpoints": entries}
    ckpt_dir = Path(ckpt_dir)
    target = ckpt_dir / BEST_FILE
    tmp = ckpt_dir / f".{BEST_FILE}.tmp-{os.getpid()}"
    for stale in ckpt_dir.glob(f".{BEST_FILE}.tmp-*"):  # left by a writer that crashed
        stale.unlink(missing_ok=True)
    with open(tmp, "wb") as fh:
        fh.write(json.dumps(doc, indent=1).encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return target


def read_best(ckpt_dir: Path) -> list[dict[str, Any]]:
    """The entries of ``ckpt_dir/best.json``, best first ([] where there is none).

    Each is ``{"name", "step", "heldout_loss", "heldout_acc", "best"}``. The index
    may name a checkpoint deleted since by hand: check that it exists (and verify it) before
    loading it.

    Raises:
        ValueError: If the file is not a ``best.json`` (naming it).
    """
    path = Path(ckpt_dir) / BEST_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); it is rewritten at the next "
                         "checkpoint, and every checkpoint's MANIFEST.json holds its own score") \
            from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT \
            or not isinstance(doc.get("checkpoints"), list):
        raise ValueError(f"{path} is not a {FORMAT} index; every checkpoint's MANIFEST.json "
                         "holds its own score")
    return list(doc["checkpoints"])
