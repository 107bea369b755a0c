"""Writing the model's output: a Kaldi archive (what ``latgen-faster-mapped`` reads) or HDF5.

HDF5 layout (``format`` attribute ``hadpsgd-loglikes/1``; what ``hadpsgd.decode`` reads):

- ``loglikes`` float32 ``[frames, classes]``: utterance after utterance, in input order;
- ``offsets`` int64 ``[utts + 1]``: utterance ``u`` is rows ``offsets[u]:offsets[u + 1]``;
- ``utt_ids`` strings ``[utts]``;
- attributes: ``kind`` (``log-posteriors`` or ``pseudo-log-likelihoods``), ``num_classes``,
  ``priors`` (the priors' source, empty without), ``checkpoint``, ``context``,
  ``chunk_len``, ``chunk_overlap``, ``precision``.

Every file is written under a hidden temporary name in its own directory
(``.out.ark.tmp-<pid>``), flushed to disk (fsync) and renamed into place only when complete,
so no reader ever sees half an output under its final name: an archive before its scp, whose
byte offsets name the archive by its final name. An output that is already there is refused
(:func:`check_new`) unless ``--overwrite``; then the old one is replaced by the rename, and an
old scp is removed before a new archive takes its archive's name, so that no index ever points
into bytes it was not written for. Standard output and pipes are streams, written as they
come.

Under mpirun every rank writes its part (:func:`part_spec`) the same way, and rank 0 makes one
output of them (:func:`merge`): the parts of an ``.h5`` are copied into it in rank order,
which is input order; an ``ark,scp`` keeps the rank's archives (``out.<rank>.ark``) and rank
0 writes one ``scp`` listing every utterance in input order (nothing is copied); a bare
``ark:`` is the rank archives concatenated (an archive is a sequence of self-contained
entries).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hadpsgd.forward.model import ForwardError

FORMAT = "hadpsgd-loglikes/1"
_CHUNK_BYTES = 4 << 20  # HDF5 chunk of loglikes rows: a few MiB whatever the class count
_COPY_ROWS_BYTES = 256 << 20  # rows copied per block when parts are merged


@dataclass(frozen=True)
class OutputSpec:
    """Where the output goes: an ``.h5`` path, or a Kaldi wspecifier's archive (and scp)."""

    h5: Path | None = None
    ark: str | None = None
    scp: str | None = None
    text: bool = False

    @property
    def in_files(self) -> bool:
        """Whether every target is a plain file (not standard output, not a pipe)."""
        names = [n for n in (self.ark, self.scp) if n is not None]
        return self.h5 is not None or not any(_streamed(n) for n in names)

    def files(self) -> list[Path]:
        """The plain files written (not the streams)."""
        if self.h5 is not None:
            return [self.h5]
        return [Path(n) for n in (self.ark, self.scp) if n is not None and not _streamed(n)]

    def describe(self) -> str:
        """The output as the user would name it."""
        if self.h5 is not None:
            return str(self.h5)
        opts = "ark" + (",t" if self.text else "") + (",scp" if self.scp else "")
        return f"{opts}:{self.ark}" + (f",{self.scp}" if self.scp else "")


def parse_output(spec: str) -> OutputSpec:
    """``--out``: a Kaldi wspecifier (``ark:``, ``ark,scp:``, ``ark,t:``) or an ``.h5`` path.

    Raises:
        ForwardError: For anything else, or a directory that is not there to write in.
    """
    if spec.startswith(("ark", "scp")) and ":" in spec:
        from hadpsgd.forward.features import _kaldiio

        try:
            parsed = _kaldiio().utils.parse_specifier(spec)
        except (ValueError, KeyError) as err:
            raise ForwardError(f"--out {spec} is not a Kaldi wspecifier ({err}); write "
                               "ark:out.ark or ark,scp:out.ark,out.scp") from None
        if parsed["ark"] is None:
            raise ForwardError(f"--out {spec} names no archive; write ark,scp:out.ark,"
                               "out.scp (an scp alone indexes nothing)")
        out = OutputSpec(ark=parsed["ark"], scp=parsed["scp"], text=bool(parsed["t"]))
        if out.scp is not None and _streamed(parsed["ark"]):
            raise ForwardError(f"--out {spec}: an scp holds byte offsets into a file, but "
                               f"the archive {parsed['ark']} is a stream; write the archive "
                               "to a file (ark,scp:out.ark,out.scp) or drop the scp (ark:-)")
    elif spec.endswith((".h5", ".hdf5")):
        out = OutputSpec(h5=Path(spec))
    else:
        raise ForwardError(f"--out {spec} is neither a Kaldi wspecifier (ark:out.ark, "
                           "ark,scp:out.ark,out.scp) nor an HDF5 file ending in .h5")
    for path in out.files():
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ForwardError(f"--out: directory {parent} does not exist; create it or "
                               "write elsewhere")
        if not writable(parent):
            raise ForwardError(f"--out: directory {parent} is not writable; write "
                               "elsewhere or fix its permissions")
    return out


def writable(directory: Path) -> bool:
    """Whether a file can be made in ``directory``, tried (a probe made and removed at once).

    ``os.access`` alone answers yes to root for any directory, also one that refuses new
    files (``/proc``, a read-only bind mount seen as writable): the write would then fail
    only after the work, with a traceback.
    """
    if not os.access(directory, os.W_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _streamed(name: str) -> bool:
    """Whether a Kaldi target is a stream (standard output or a pipe) rather than a file."""
    return name == "-" or "|" in name


def temp_path(path: Path) -> Path:
    """Where ``path`` is written until complete: hidden, in its own directory.

    The same directory because a rename across file systems would be a copy, which can be
    seen half-done.
    """
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_dir(directory: Path) -> None:
    # Some file systems (FUSE, older NFS) refuse a directory's fsync: the rename stands anyway.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Rename the complete file ``tmp`` to ``final``, its bytes on disk before its name."""
    fd = os.open(tmp, os.O_RDONLY)  # fsync writes back the file's pages whatever descriptor
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)  # atomic: a reader sees the old file or the new one, never half
    _fsync_dir(final.parent)


def _part_name(name: str, rank: int) -> str:
    path = Path(name)
    return str(path.with_name(f"{path.stem}.{rank}{path.suffix}"))


def part_spec(out: OutputSpec, rank: int) -> OutputSpec:
    """Rank ``rank``'s part of ``out`` under mpirun: ``out.h5`` -> ``out.<rank>.h5``, etc."""
    if out.h5 is not None:
        return replace(out, h5=Path(_part_name(str(out.h5), rank)))
    assert out.ark is not None
    return replace(out, ark=_part_name(out.ark, rank),
                   scp=_part_name(out.scp, rank) if out.scp else None)


class H5Writer:
    """Writes the HDF5 layout of the module docstring, complete or not at all."""

    def __init__(self, path: Path, num_classes: int, attrs: dict[str, Any]) -> None:
        self.path = Path(path)
        self.tmp = temp_path(self.path)
        self.h5 = h5py.File(self.tmp, "w")
        rows = max(1, _CHUNK_BYTES // (4 * num_classes))
        self.data = self.h5.create_dataset("loglikes", shape=(0, num_classes), dtype="f4",
                                           maxshape=(None, num_classes),
                                           chunks=(rows, num_classes))
        self.h5.attrs.update({"format": FORMAT, "num_classes": num_classes, **attrs})
        self.offsets, self.ids = [0], []

    def write(self, utt: str, mat: np.ndarray) -> None:
        """Append one utterance's matrix."""
        start = self.offsets[-1]
        self.data.resize(start + len(mat), axis=0)
        self.data[start:] = mat
        self.offsets.append(start + len(mat))
        self.ids.append(utt)

    def close(self) -> None:
        """Write the index and move the file into place."""
        self.h5.create_dataset("offsets", data=np.asarray(self.offsets, np.int64))
        self.h5.create_dataset("utt_ids", data=self.ids, dtype=h5py.string_dtype())
        self.h5.close()
        commit(self.tmp, self.path)

    def abort(self) -> None:
        """Drop the unfinished file."""
        if self.h5.id.valid:
            self.h5.close()
        self.tmp.unlink(missing_ok=True)


class _Target:
    """One file of a Kaldi output, open under its temporary name; or a stream (``-``, a pipe)."""

    def __init__(self, name: str, mode: str) -> None:
        from hadpsgd.forward.features import _kaldiio

        self.name = name
        self.tmp = None if _streamed(name) else temp_path(Path(name))
        self.fd: Any = (_kaldiio().utils.open_like_kaldi(name, mode) if self.tmp is None else
                        open(self.tmp, mode, encoding=None if "b" in mode else "utf-8"))

    def close(self) -> None:
        """Close it, and move a file into place."""
        self.fd.close()
        if self.tmp is not None:
            commit(self.tmp, Path(self.name))

    def abort(self) -> None:
        """Close it, and drop an unfinished file."""
        try:
            self.fd.close()
        finally:
            if self.tmp is not None:
                self.tmp.unlink(missing_ok=True)


class ArkWriter:
    """Writes a Kaldi archive (and scp) in kaldiio's format, each file complete or not at all.

    The scp's offsets are counted here rather than by kaldiio, which would name the archive
    by the temporary name it is open under: an entry is ``utt <final ark name>:<offset of the
    matrix>``, as Kaldi writes it.
    """

    def __init__(self, out: OutputSpec) -> None:
        from hadpsgd.forward.features import _kaldiio

        assert out.ark is not None
        self.save, self.text = _kaldiio().save_ark, out.text
        self.ark = _Target(out.ark, "wb")
        self.scp: _Target | None = None
        try:
            self.scp = _Target(out.scp, "w") if out.scp is not None else None
        except BaseException:
            self.ark.abort()
            raise

    def write(self, utt: str, mat: np.ndarray) -> None:
        """Append one utterance's matrix (and its scp line)."""
        start = self.ark.fd.tell() if self.scp is not None else 0
        self.save(self.ark.fd, {utt: mat}, text=self.text)
        if self.scp is not None:  # the matrix starts after "utt " (kaldiio writes it in UTF-8)
            self.scp.fd.write(f"{utt} {self.ark.name}:{start + len(f'{utt} '.encode())}\n")

    def close(self) -> None:
        """Move the archive into place, then the scp (an index never names a missing file)."""
        if self.scp is not None and self.scp.tmp is not None:
            # An old index (--overwrite) goes first: it must never point into the new archive.
            Path(self.scp.name).unlink(missing_ok=True)
        self.ark.close()
        if self.scp is not None:
            self.scp.close()

    def abort(self) -> None:
        """Drop what was written to files (a stream keeps what it was sent)."""
        try:
            self.ark.abort()
        finally:
            if self.scp is not None:
                self.scp.abort()


def open_writer(out: OutputSpec, num_classes: int, attrs: dict[str, Any]) -> H5Writer | ArkWriter:
    """The writer of ``out``."""
    if out.h5 is not None:
        return H5Writer(out.h5, num_classes, attrs)
    return ArkWriter(out)


def _merge_h5(out: Path, parts: list[Path]) -> None:
    tmp = temp_path(out)
    try:
        with h5py.File(tmp, "w") as dst:
            sources = [h5py.File(p, "r") for p in parts]
            try:
                first = sources[0]
                classes = first["loglikes"].shape[1]
                total = sum(s["loglikes"].shape[0] for s in sources)
                rows = max(1, _CHUNK_BYTES // (4 * classes))
                data = dst.create_dataset("loglikes", shape=(total, classes), dtype="f4",
                                          chunks=(min(rows, max(total, 1)), classes))
                dst.attrs.update(dict(first.attrs))
                offsets, ids, at = [np.zeros(1, np.int64)], [], 0
                block = max(1, _COPY_ROWS_BYTES // (4 * classes))
                for src in sources:
                    n = src["loglikes"].shape[0]
                    for lo in range(0, n, block):
                        data[at + lo:at + min(lo + block, n)] = src["loglikes"][lo:lo + block]
                    offsets.append(src["offsets"][1:] + at)
                    ids.extend(src["utt_ids"].asstr()[()])
                    at += n
                dst.create_dataset("offsets", data=np.concatenate(offsets))
                dst.create_dataset("utt_ids", data=ids, dtype=h5py.string_dtype())
            finally:
                for src in sources:
                    src.close()
        commit(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    for part in parts:
        part.unlink()


def _concatenate(out: str, parts: list[str]) -> None:
    tmp = temp_path(Path(out))
    try:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        commit(tmp, Path(out))
    finally:
        tmp.unlink(missing_ok=True)
    for part in parts:
        Path(part).unlink()


def merge(out: OutputSpec, size: int) -> list[str]:
    """Make ``out`` of the ``size`` ranks' parts (rank 0, after every part is complete).

    Returns:
        The files that hold the output (the rank archives stay where an scp indexes them).
    """
    parts = [part_spec(out, r) for r in range(size)]
    if out.h5 is not None:
        _merge_h5(out.h5, [p.h5 for p in parts if p.h5 is not None])
        return [str(out.h5)]
    arks = [p.ark for p in parts if p.ark is not None]
    if out.scp is not None:
        _concatenate(out.scp, [p.scp for p in parts if p.scp is not None])
        return [out.scp, *arks]
    assert out.ark is not None
    _concatenate(out.ark, arks)
    return [out.ark]
