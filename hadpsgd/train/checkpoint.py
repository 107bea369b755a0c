"""Atomic checkpoints: write to a temp file, fsync, rename; a crash never leaves half a file."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^ckpt-step(\d+)\.pt$")


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    """The file name of the checkpoint taken after global ``step``."""
    return Path(ckpt_dir) / f"ckpt-step{step:08d}.pt"


def save_checkpoint(state: dict[str, Any], path: Path) -> Path:
    """Save ``state`` to ``path`` atomically.

    The data go to a temporary file in the same directory, are fsynced, and the file is
    renamed over ``path`` (atomic on POSIX); the directory is fsynced so the rename survives
    a power loss. A ``latest`` pointer file is updated the same way.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda fh: torch.save(state, fh))
    _atomic_write(path.parent / "latest", lambda fh: fh.write(path.name.encode() + b"\n"))
    return path


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``ckpt_dir``, or None if there is none."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / "latest"
    if pointer.is_file():
        candidate = ckpt_dir / pointer.read_text().strip()
        if candidate.is_file():
            return candidate
    found = sorted((int(m.group(1)), p) for p in ckpt_dir.glob("ckpt-step*.pt")
                   if (m := _NAME.match(p.name)))
    return found[-1][1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint onto the CPU.

    Raises:
        FileNotFoundError: If ``path`` does not exist, naming it.
        ValueError: If the file is not a hadpsgd checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
        raise ValueError(f"checkpoint {path} could not be read ({err}); is it complete?") from err
    if not isinstance(state, dict) or "model" not in state or "progress" not in state:
        raise ValueError(f"{path} is not a hadpsgd checkpoint (no model/progress entries)")
    return state
