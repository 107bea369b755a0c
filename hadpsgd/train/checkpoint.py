"""Crash-safe checkpoints: one directory per checkpoint, a manifest with checksums, keep last K.

Layout under ``<out-dir>/checkpoints``::

    step-00000120/state.pt        the torch.save'd state (rank 0's, common to all)
    step-00000120/node-00003.pt   a super-learner's own part, where they differ (BMUF
                                  mid-block): written by that node's leader (sharded)
    step-00000120/MANIFEST.json   size and SHA-256 of every file, step, world size, algorithm
    latest                        name of the newest complete checkpoint (informative)
    best.json                     the checkpoints with a held-out score, best first
                                  (:mod:`hadpsgd.train.best`)

A checkpoint is written into a hidden temporary directory (data file fsynced, then the
manifest fsynced, then the directory), renamed into place (atomic on POSIX) and the parent
directory fsynced; only then does ``latest`` move and old checkpoints get pruned (the newest
``keep``, and the ``keep_best`` with the lowest held-out loss, stay). A crash at
any point leaves either the previous checkpoints untouched or the new one complete. The
node parts go into the same temporary directory before rank 0 writes the manifest
(:mod:`hadpsgd.train.shards`), so the rename publishes all parts or none. Readers
never trust a name alone: :func:`latest_checkpoint` verifies the manifest and the checksums
and skips, by name, any checkpoint that is truncated or corrupted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hadpsgd.api.state import tensor_bytes
from hadpsgd.train.best import BEST_FILE, rank, write_best
from hadpsgd.train.checkpoint_read import (
    FORMAT,
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    verify_checkpoint,
)


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, no permission); the previous ones stand."""


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _no_space(parent: Path, path: Path, state: Any) -> str:
    """The message of a checkpoint that does not fit: where, how much, and the way on."""
    there = parent
    while not there.exists() and there != there.parent:  # a folder the full disk never made
        there = there.parent
    free = shutil.disk_usage(there).free
    return (f"no space left in {parent} for checkpoint {path.name}: it needs about "
            f"{_mib(tensor_bytes(state))} and {_mib(free)} are free. The previous checkpoints "
            "are intact: free space (or lower --keep-checkpoints, or point --out-dir "
            "elsewhere), then continue with --resume auto")


def _os_error(err: BaseException | None) -> OSError | None:
    """The OSError behind ``err`` (itself, or one it was raised from or while handling)."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    """The directory of the checkpoint taken after global ``step``."""
    return Path(ckpt_dir) / f"step-{step:08d}"


class _HashingWriter:
    """A binary file wrapper that hashes and counts what passes through (one read-free pass)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def staging_dir(path: Path) -> Path:
    """Make the hidden temporary directory checkpoint ``path`` is written into; returns it.

    Raises:
        CheckpointWriteError: If it cannot be made (naming the directory and the fix).
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointWriteError(f"checkpoint {path.name} could not be started in "
                                   f"{path.parent} ({err.strerror or err}); the previous "
                                   "checkpoints are intact: fix that, then continue with "
                                   "--resume auto") from None
    return tmp


def write_file(path: Path, obj: Any) -> dict[str, Any]:
    """``torch.save`` plain data ``obj`` to ``path``, fsynced; returns its manifest entry.

    Raises:
        TypeError: If ``obj`` is not plain data (a bug of ours).
        OSError, RuntimeError: As the write fails (the caller names the checkpoint).
    """
    problem = plain_data_problem(obj)
    if problem is not None:  # a bug of ours: the checkpoint would not load back
        raise TypeError(f"checkpoint state must be plain data (see plain_data_problem): "
                        f"{problem}")
    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        torch.save(obj, writer)  # type: ignore[arg-type] - any object with write()
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": writer.size, "sha256": writer.sha.hexdigest()}


def write_error(err: BaseException, path: Path, obj: Any) -> CheckpointWriteError | None:
    """The error to raise for a failed write of ``obj`` into checkpoint ``path``.

    Returns:
        A :class:`CheckpointWriteError` naming the directory and the fix, or None where
        ``err`` is not a file-system failure (a bug: the caller re-raises it).
    """
    cause = _os_error(err)  # torch.save reports a failed write as a RuntimeError
    if cause is None:
        return None
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointWriteError(_no_space(path.parent, path, obj))
    return CheckpointWriteError(f"checkpoint {path.name} could not be written in {path.parent} "
                                f"({cause.strerror or cause}); the previous checkpoints are "
                                "intact: fix that, then continue with --resume auto")


def has_room(path: Path, obj: Any) -> None:
    """Refuse, before a byte is written, a write of ``obj`` that does not fit beside ``path``.

    Raises:
        CheckpointWriteError: Naming the directory, the space needed and the fix.
    """
    parent = Path(path).parent
    parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(parent).free < tensor_bytes(obj):
        raise CheckpointWriteError(_no_space(parent, Path(path), obj))


def save_checkpoint(state: dict[str, Any], path: Path, keep: int = 0,
                    meta: dict[str, Any] | None = None,
                    on_phase: Callable[[str], None] | None = None,
                    staged: Path | None = None,
                    parts: dict[str, dict[str, Any]] | None = None,
                    keep_best: int = 0) -> Path:
    """Write ``state`` as the checkpoint directory ``path``, crash-safely.

    Args:
        state: What to save: plain data only (:func:`plain_data_problem`), which
            ``torch.load(weights_only=True)`` reads back without running any code.
        path: The checkpoint directory (see :func:`checkpoint_path`).
        keep: Keep only the newest ``keep`` checkpoints afterwards (0 keeps all).
        meta: Extra manifest fields (world size, algorithm, ...), readable without loading;
            ``heldout`` (:data:`hadpsgd.train.best.SCORE_KEY`) is the held-out score.
        on_phase: Called with ``"ckpt-data"``, ``"ckpt-manifest"`` and ``"ckpt-rename"`` as
            each phase completes (the fault-injection hook of the tests).
        staged: The temporary directory (:func:`staging_dir`) that already holds ``parts``,
            written by other ranks (:mod:`hadpsgd.train.shards`); None makes one.
        parts: The manifest entries (:func:`write_file`) of the files in ``staged``.
        keep_best: Pruning spares the ``keep_best`` checkpoints with the lowest held-out loss.

    Returns:
        ``path``.
    """
    path = Path(path)
    parent = path.parent
    try:
        has_room(path, state)  # refused before a byte is written: the previous ones stand
    except (CheckpointWriteError, OSError) as err:  # OSError: its folder could not be made
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        if isinstance(err, CheckpointWriteError):
            raise
        raise write_error(err, path, state) or err from None
    tmp = staged if staged is not None else staging_dir(path)
    old: Path | None = None
    try:
        files = {STATE_FILE: write_file(tmp / STATE_FILE, state), **(parts or {})}
        if on_phase:
            on_phase("ckpt-data")
        manifest = {
            "format": FORMAT,
            "name": path.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
            **(meta or {}),
        }
        _write_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if on_phase:
            on_phase("ckpt-manifest")
        if path.exists():  # the same step checkpointed again (e.g. after a resume)
            old = parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
            old = None
        else:
            os.replace(tmp, path)
        _fsync_dir(parent)
    except (OSError, RuntimeError) as err:
        _undo(tmp, old, path)
        failed = write_error(err, path, state)
        if failed is None:
            raise
        raise failed from None
    except BaseException:
        _undo(tmp, old, path)
        raise
    if on_phase:
        on_phase("ckpt-rename")
    pointer = parent / "latest"
    tmp_pointer = parent / f".latest.tmp-{os.getpid()}"
    try:
        _write_synced(tmp_pointer, path.name.encode() + b"\n")
        os.replace(tmp_pointer, pointer)
        _fsync_dir(parent)
    except OSError as err:
        # The checkpoint itself is complete (``latest`` is informative: --resume auto finds
        # the newest valid checkpoint by name and checksum).
        tmp_pointer.unlink(missing_ok=True)
        raise CheckpointWriteError(f"checkpoint {path} is complete but {pointer} could not be "
                                   f"updated ({err.strerror or err}); --resume auto will find "
                                   "the checkpoint: fix that, then continue") from None
    if keep > 0:
        prune(parent, keep, keep_best)
    else:
        refresh_best(parent, keep_best)
    return path


def _undo(tmp: Path, old: Path | None, path: Path) -> None:
    """Clear a failed write's temporary ``tmp``; put back the checkpoint moved aside to ``old``.

    The same step written again moves the older checkpoint aside for the new one: where the
    new one never took its place, the older one goes back to ``path`` (a hidden ``.old-``
    folder is neither found by a resume nor spared by :func:`prune`).
    """
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and old.exists() and not path.exists():
        os.replace(old, path)


_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def plain_data_problem(obj: Any, where: str = "state") -> str | None:
    """Where ``obj`` holds something ``torch.load(weights_only=True)`` would refuse, or None.

    Plain data is tensors, numbers, strings, None, dtypes and devices, in dicts, lists and
    tuples (a named tuple or a dataclass is not: write it as a dict).
    """
    if isinstance(obj, torch.Tensor):
        return None if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter) \
            else f"{where} is a {type(obj).__name__}"
    if isinstance(obj, _PLAIN):
        return None
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                return f"{where} has a key of type {type(key).__name__}"
            problem = plain_data_problem(value, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    if type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            problem = plain_data_problem(value, f"{where}[{i}]")
            if problem:
                return problem
        return None
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scored_checkpoints(ckpt_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The checkpoints in ``ckpt_dir`` with a held-out score, best first, with their manifests.

    Best is the lowest held-out loss (``manifest["heldout"]["loss"]``; of a tie, the newer
    one). Manifests are read, not the data verified: verify a checkpoint before loading it.
    One whose manifest is missing or damaged is left out.
    """
    found = []
    for path in list_checkpoints(ckpt_dir):
        try:
            found.append((path, read_manifest(path)))
        except CheckpointError:
            continue
    return rank(found)


def refresh_best(ckpt_dir: Path, keep_best: int,
                 ranked: list[tuple[Path, dict[str, Any]]] | None = None) -> None:
    """Rewrite ``best.json`` from the manifests on disk (where any has a score, or it exists)."""
    ranked = scored_checkpoints(ckpt_dir) if ranked is None else ranked
    if not ranked and not (Path(ckpt_dir) / BEST_FILE).exists():
        return
    try:
        write_best(Path(ckpt_dir), ranked, keep_best)
    except OSError as err:
        # The checkpoints are complete; the index is rewritten at the next one.
        raise CheckpointWriteError(f"{Path(ckpt_dir) / BEST_FILE} could not be written "
                                   f"({err.strerror or err}); the checkpoints are complete "
                                   "(each MANIFEST.json holds its score): fix that, then "
                                   "continue with --resume auto") from None


def prune(ckpt_dir: Path, keep: int, keep_best: int = 0) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints, and stale temporaries; returns removed.

    The ``keep_best`` checkpoints with the lowest held-out loss (:func:`scored_checkpoints`)
    are never deleted, however old; ``best.json`` is rewritten for what remains.
    """
    ranked = scored_checkpoints(ckpt_dir)
    spared = {path for path, _ in ranked[:max(keep_best, 0)]}
    removed = []
    for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        if old in spared:
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    for tmp in Path(ckpt_dir).glob(".step-*"):
        # Left by a writer that crashed; a live writer's own pid suffix is never stale here
        # because only one rank writes, one checkpoint at a time.
        if not tmp.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)
    refresh_best(ckpt_dir, keep_best, [(p, m) for p, m in ranked if p not in removed])
    return removed


__all__ = ["FORMAT", "MANIFEST_FILE", "STATE_FILE", "CheckpointError", "CheckpointWriteError",
           "checkpoint_path", "has_room", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "plain_data_problem", "prune", "read_manifest", "refresh_best",
           "save_checkpoint", "scored_checkpoints", "staging_dir", "verify_checkpoint",
           "write_error", "write_file"]
