"""Reading checkpoints: list them, read and verify a manifest, find the newest valid one, load.

Readers never trust a name alone: :func:`latest_checkpoint` verifies the manifest and the
checksums and skips, by name, any checkpoint that is truncated or corrupted;
:func:`load_checkpoint` unpickles plain data only. Writing, pruning and the layout on disk are
:mod:`hadpsgd.train.checkpoint`'s, which re-exports every name here.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FORMAT = "hadpsgd-checkpoint/1"
STATE_FILE = "state.pt"
MANIFEST_FILE = "MANIFEST.json"
_NAME = re.compile(r"^step-(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and why."""


def _first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message (torch's are paragraphs)."""
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint directories in ``ckpt_dir`` by name (complete or not), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``.

    Raises:
        CheckpointError: If it is missing or unreadable.
    """
    mpath = Path(path) / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST_FILE} (incomplete write)") \
            from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} is unreadable ({err})") \
            from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} is not a JSON object "
                              "(damaged)")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r} is not "
                              f"{FORMAT!r}")
    files = manifest.get("files")
    # The manifest vouches for the data only if it lists state.pt with a size and a checksum:
    # an empty or malformed list would verify nothing.
    if not isinstance(files, dict) or STATE_FILE not in files:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} does not list {STATE_FILE} "
                              "(damaged)")
    for name, want in files.items():
        if (not isinstance(want, dict) or type(want.get("bytes")) is not int
                or not isinstance(want.get("sha256"), str) or "/" in name or name in ("", ".",
                                                                                    "..")):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE}'s entry for {name!r} "
                                  "has no valid size and SHA-256 (damaged)")
    return manifest


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file of checkpoint ``path`` against its manifest; returns the manifest.

    Raises:
        CheckpointError: Naming the checkpoint, the file and what is wrong (missing,
            truncated, checksum mismatch).
    """
    path = Path(path)
    manifest = read_manifest(path)
    for name, want in manifest["files"].items():
        fpath = path / name
        if not fpath.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = fpath.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} is {size} bytes but the manifest "
                                  f"says {want['bytes']} (truncated?)")
        sha = hashlib.sha256()
        with open(fpath, "rb") as fh:
            while block := fh.read(1 << 22):
                sha.update(block)
        if sha.hexdigest() != want["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} fails its SHA-256 checksum "
                                  "(corrupted)")
    return manifest


def latest_checkpoint(ckpt_dir: Path,
                      report: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete, valid checkpoint in ``ckpt_dir``, or None.

    Checkpoints that fail :func:`verify_checkpoint` are skipped; ``report`` (e.g. ``print``)
    is told about each one by name and reason.
    """
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            if report:
                report(f"skipping {err}")
            continue
        return path
    return None


def load_checkpoint(path: Path, verify: bool = True) -> dict[str, Any]:
    """Load checkpoint ``path`` (a checkpoint directory) onto the CPU.

    Args:
        path: The checkpoint directory.
        verify: Check the manifest's checksums first.

    Only plain data is unpickled (``weights_only=True``): a checkpoint that holds any other
    object is refused, and nothing it names is imported or called.

    Raises:
        FileNotFoundError: If ``path`` does not exist, naming it.
        CheckpointError: If it is incomplete, corrupted, not a hadpsgd checkpoint, or holds
            objects beyond plain data.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check --resume")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (step-NNNNNNNN with "
                              f"{STATE_FILE} and {MANIFEST_FILE}); check --resume")
    if verify:
        verify_checkpoint(path)
    try:
        # weights_only: the unpickler builds tensors, numbers, strings and containers and
        # nothing else, so a checkpoint from elsewhere cannot run code on every rank.
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors, numbers, strings and "
            f"containers, and loading it could run code ({_first_line(err)}). hadpsgd writes "
            "only such plain data; if you trust where this file came from, load it yourself "
            "with torch.load(..., weights_only=False), keep its plain parts and save them again "
            "with hadpsgd.train.checkpoint.save_checkpoint") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {path} could not be read ({err})") from err
    if not isinstance(state, dict) or "model" not in state or "progress" not in state:
        raise CheckpointError(f"{path} is not a hadpsgd checkpoint (no model/progress entries)")
    return state


__all__ = ["FORMAT", "MANIFEST_FILE", "STATE_FILE", "CheckpointError", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "read_manifest", "verify_checkpoint"]
