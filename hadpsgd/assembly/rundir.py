"""A run directory holds one run: a fresh start never writes into another run's directory.

Two runs in one ``--out-dir`` mix their ``metrics.jsonl`` records, move ``checkpoints/latest``
between them, and a later ``--resume auto`` (or ``--keep-checkpoints`` pruning) acts on the
wrong one. So a start without ``--resume`` in a directory that already holds a run stops
before anything is written, naming what is there and the two ways on; ``--overwrite`` deletes
the old run's files first.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

RUN_FILES = ("config.json", "metrics.jsonl", "priors.json", "train.log", "plot.png")
"""Files of a run directory that hadpsgd writes (besides the two folders below): the log of
rank 0's console (:mod:`hadpsgd.assembly.runlog`) and ``python -m hadpsgd.plot``'s figure too."""
RUN_DIRS = ("checkpoints", "tb")
"""Folders of a run directory that hadpsgd writes: checkpoints and TensorBoard events."""


def _last_step(metrics: Path) -> int | None:
    """The largest ``step`` of the records in ``metrics`` (None if none is readable)."""
    last = None
    try:
        with metrics.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int):
                    last = step if last is None else max(last, step)
    except OSError:
        return None
    return last


def existing_run(out: Path) -> str | None:
    """What of a run ``out`` already holds, in a few words, or None if it holds none."""
    out = Path(out)
    if not out.is_dir():
        return None
    found = []
    for name in RUN_FILES:
        if (out / name).is_file():
            step = _last_step(out / name) if name == "metrics.jsonl" else None
            found.append(name + (f" (up to step {step})" if step is not None else ""))
    for name in RUN_DIRS:
        folder = out / name
        if folder.is_dir() and any(folder.iterdir()):
            steps = sorted(p.name for p in folder.glob("step-*")) if name == "checkpoints" else []
            found.append(f"{name}/" + (f" ({steps[0]} .. {steps[-1]})" if steps else ""))
    return ", ".join(found) if found else None


def start_problem(out: Path, resume: str | None, overwrite: bool) -> str | None:
    """Why a run may not start in ``out`` as asked, or None (then it may).

    Args:
        out: The run directory (``--out-dir``).
        resume: ``--resume`` (None for a fresh start).
        overwrite: ``--overwrite``: a fresh start may delete the run that is there.
    """
    if resume is not None or overwrite:
        return None
    held = existing_run(out)
    if held is None:
        return None
    return (f"--out-dir {out} already holds a run ({held}); a new run there would mix its "
            f"records and checkpoints with it. Continue that run with --resume auto "
            f"--out-dir {out}, or start a new one with another --out-dir (or --overwrite to "
            "delete the old run's files and start over)")


def writable_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the run directory (a file, not writable), or None.

    Nothing is left behind: a missing directory is not made here (bad input found later must
    leave no trace), its nearest existing ancestor is probed instead, with one file written
    and removed, since permissions alone do not tell (root, read-only mounts, quotas).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        return f"--out-dir {out} is a file, not a directory; choose another --out-dir"
    target = out
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return (f"--out-dir {out} cannot be made: {target} is a file, not a directory; "
                "choose another --out-dir")
    try:
        probe = target / f".hadpsgd-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return (f"--out-dir {out} is not writable ({err.strerror or err} in {target}); make "
                "it writable for this user, or use another --out-dir (to resume this run "
                "there, copy its directory first)")
    return None


def clear_run(out: Path) -> list[str]:
    """Delete the files and folders of a run that hadpsgd wrote in ``out``; returns their names.

    Only hadpsgd's own names are touched (:data:`RUN_FILES`, :data:`RUN_DIRS`): anything else
    a user keeps in the directory stays.
    """
    out = Path(out)
    removed = []
    for name in RUN_FILES:
        if (out / name).is_file():
            (out / name).unlink()
            removed.append(name)
    for name in RUN_DIRS:
        folder = out / name
        if folder.is_symlink() and folder.is_dir():
            # A folder kept elsewhere (a bigger disk): empty it and keep the link the user made.
            for child in folder.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            removed.append(f"{name}/ (the contents of {folder.resolve()})")
        elif folder.is_dir():
            shutil.rmtree(folder)
            removed.append(f"{name}/")
    return removed


__all__ = ["clear_run", "existing_run", "start_problem", "writable_problem"]
