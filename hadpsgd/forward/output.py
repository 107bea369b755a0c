"""Writing the model's output: a Kaldi archive (what ``latgen-faster-mapped`` reads) or HDF5.

HDF5 layout (``format`` attribute ``hadpsgd-loglikes/1``; what ``hadpsgd.decode`` reads):

- ``loglikes`` float32 ``[frames, classes]``: utterance after utterance, in input order;
- ``offsets`` int64 ``[utts + 1]``: utterance ``u`` is rows ``offsets[u]:offsets[u + 1]``;
- ``utt_ids`` strings ``[utts]``;
- attributes: ``kind`` (``log-posteriors`` or ``pseudo-log-likelihoods``), ``num_classes``,
  ``priors`` (the priors' source, empty without), ``checkpoint``, ``context``,
  ``chunk_len``, ``chunk_overlap``, ``precision``.

An HDF5 file is written under a temporary name and renamed when complete. Under mpirun every
rank writes its part (:func:`part_spec`) and rank 0 makes one output of them
(:func:`merge`): the parts of an ``.h5`` are copied into it in rank order, which is input
order; an ``ark,scp`` keeps the rank's archives (``out.<rank>.ark``) and rank 0 writes one
``scp`` listing every utterance in input order (nothing is copied); a bare ``ark:`` is the
rank archives concatenated (an archive is a sequence of self-contained entries).
"""

from __future__ import annotations

import os
import shutil
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
        return self.h5 is not None or all(n != "-" and "|" not in n for n in names)

    def files(self) -> list[Path]:
        """The plain files written (for the directory checks)."""
        if self.h5 is not None:
            return [self.h5]
        return [Path(n) for n in (self.ark, self.scp) if n is not None and self.in_files]

    def describe(self) -> str:
        """The output as the user would name it."""
        if self.h5 is not None:
            return str(self.h5)
        opts = "ark" + (",t" if self.text else "") + (",scp" if self.scp else "")
        return f"{opts}:{self.ark}" + (f",{self.scp}" if self.scp else "")


def parse_output(spec: str) -> OutputSpec:
    """``--output``: a Kaldi wspecifier (``ark:``, ``ark,scp:``, ``ark,t:``) or an ``.h5`` path.

    Raises:
        ForwardError: For anything else, or a directory that is not there to write in.
    """
    if spec.startswith(("ark", "scp")) and ":" in spec:
        from hadpsgd.forward.features import _kaldiio

        try:
            parsed = _kaldiio().utils.parse_specifier(spec)
        except (ValueError, KeyError) as err:
            raise ForwardError(f"--output {spec} is not a Kaldi wspecifier ({err}); write "
                               "ark:out.ark or ark,scp:out.ark,out.scp") from None
        if parsed["ark"] is None:
            raise ForwardError(f"--output {spec} names no archive; write ark,scp:out.ark,"
                               "out.scp (an scp alone indexes nothing)")
        out = OutputSpec(ark=parsed["ark"], scp=parsed["scp"], text=bool(parsed["t"]))
    elif spec.endswith((".h5", ".hdf5")):
        out = OutputSpec(h5=Path(spec))
    else:
        raise ForwardError(f"--output {spec} is neither a Kaldi wspecifier (ark:out.ark, "
                           "ark,scp:out.ark,out.scp) nor an HDF5 file ending in .h5")
    for path in out.files():
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ForwardError(f"--output: directory {parent} does not exist; create it or "
                               "write elsewhere")
        if not os.access(parent, os.W_OK):
            raise ForwardError(f"--output: directory {parent} is not writable; write "
                               "elsewhere or fix its permissions")
    return out


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
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
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
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drop the unfinished file."""
        if self.h5.id.valid:
            self.h5.close()
        self.tmp.unlink(missing_ok=True)


class ArkWriter:
    """Writes a Kaldi archive (and scp) through kaldiio's ``WriteHelper``."""

    def __init__(self, out: OutputSpec) -> None:
        from hadpsgd.forward.features import _kaldiio

        opts = "ark" + (",t" if out.text else "") + (",scp" if out.scp else "")
        target = out.ark + (f",{out.scp}" if out.scp else "")
        self.helper = _kaldiio().WriteHelper(f"{opts}:{target}")

    def write(self, utt: str, mat: np.ndarray) -> None:
        """Append one utterance's matrix."""
        self.helper(utt, mat)

    def close(self) -> None:
        """Close the archive (and scp)."""
        self.helper.close()

    def abort(self) -> None:
        """Close what was written (a Kaldi archive has no commit)."""
        self.helper.close()


def open_writer(out: OutputSpec, num_classes: int, attrs: dict[str, Any]) -> H5Writer | ArkWriter:
    """The writer of ``out``."""
    if out.h5 is not None:
        return H5Writer(out.h5, num_classes, attrs)
    return ArkWriter(out)


def _merge_h5(out: Path, parts: list[Path]) -> None:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
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
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    for part in parts:
        part.unlink()


def _concatenate(out: str, parts: list[str]) -> None:
    tmp = Path(out).with_name(f".{Path(out).name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        os.replace(tmp, out)
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
