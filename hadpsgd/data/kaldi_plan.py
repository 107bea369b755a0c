"""What a Kaldi import will do, decided from its flags before any frame is read.

The CMVN (:func:`plan_cmvn`), the class count and where it comes from (:func:`class_count`),
and the check that a held-out split gets the CMVN of the training file it is imported
``--like`` (:func:`check_like_cmvn`), the output's place (:func:`check_out`), the statistics
of ``--norm-from`` (:func:`checked_norm`), and a table read with its damage named by flag
(:func:`read_table`). Apart from :mod:`hadpsgd.data.kaldi`, which reads and writes, so that
each stays one job.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hadpsgd.data.cmvn import COMPUTED, PER_SPEAKER, PER_UTTERANCE, Cmvn, read_utt2spk
from hadpsgd.data.pdfs import read_num_pdfs
from hadpsgd.data.pipeline import CmvnRecord, cmvn_flags, read_record
from hadpsgd.data.reader import FeatureFile

# Kaldi rspecifier prefix such as "ark:", "scp:", "ark,t:" or "scp,p:".
_RSPECIFIER = re.compile(r"^(ark|scp)(,[a-z]+)*:")


def rspecifier(source: str) -> str:
    """Normalise a feature or alignment source to a Kaldi rspecifier.

    ``ark:...`` / ``scp:...`` (with options such as ``ark,t:``) are kept; a plain path is read
    as a table index if it ends in ``.scp`` and as an archive otherwise.
    """
    if _RSPECIFIER.match(source):
        return source
    return f"scp:{source}" if source.endswith(".scp") else f"ark:{source}"


def plan_cmvn(kaldiio: Any, utt2spk: str | os.PathLike[str] | None, stats: str | None,
              per_utt: bool, norm_vars: bool) -> tuple[Cmvn | None, CmvnRecord | None]:
    """The CMVN the flags ask for, and its record (None, None: no CMVN).

    Raises:
        ValueError: For flags that contradict each other or ask for nothing to apply.
    """
    if utt2spk is not None and per_utt:
        raise ValueError("--utt2spk (per-speaker CMVN) and --cmvn-per-utt exclude each other; "
                         "drop one")
    if utt2spk is None and stats is None and not per_utt:
        if norm_vars:
            raise ValueError("--cmvn-vars names no CMVN to apply; add --utt2spk UTT2SPK (per "
                             "speaker), --cmvn-per-utt, or --cmvn scp:cmvn.scp")
        return None, None
    per = PER_SPEAKER if utt2spk is not None else PER_UTTERANCE
    source = rspecifier(stats) if stats is not None else COMPUTED
    speakers = read_utt2spk(utt2spk) if utt2spk is not None else None
    return (Cmvn(per, norm_vars, speakers, source, kaldiio),
            CmvnRecord(per, norm_vars, source, None if utt2spk is None else str(utt2spk)))


def class_count(num_classes: int | None, tree_info: str | os.PathLike[str] | None,
                 template: FeatureFile | None) -> tuple[int | None, str]:
    """The class count and where it came from (None: the alignments' largest pdf-id + 1).

    Raises:
        ValueError: If the sources given disagree, or ``tree_info`` names no count.
    """
    source = f"--num-pdfs {num_classes}"
    if tree_info is not None:
        pdfs = read_num_pdfs(tree_info)
        if num_classes is not None and num_classes != pdfs:
            raise ValueError(f"--num-pdfs {num_classes} disagrees with --tree-info {tree_info} "
                             f"({pdfs} pdfs); drop one of them")
        num_classes, source = pdfs, f"--tree-info {tree_info} (num-pdfs {pdfs})"
    if template is not None:
        if num_classes is not None and num_classes != template.num_classes:
            raise ValueError(f"{source} disagrees with {template.path} "
                             f"({template.num_classes} classes); drop one of them")
        num_classes, source = template.num_classes, f"--like {template.path}"
    if num_classes is None:
        source = "the largest pdf-id + 1 (no --num-pdfs or --tree-info)"
    return num_classes, source


def check_like_cmvn(like: str | os.PathLike[str], ours: CmvnRecord | None) -> None:
    """Refuse a split whose CMVN would differ from that of the ``--like`` file."""
    theirs = read_record(like)
    if theirs is None:
        return
    same = ours is None if theirs.cmvn is None else theirs.cmvn.same_transform(ours)
    if not same:
        mine = ours.describe() if ours is not None else "no CMVN"
        raise ValueError(f"--like {like} was imported with {theirs.describe_cmvn()}, this split "
                         f"would get {mine}; import it with the same CMVN flags "
                         f"({cmvn_flags(theirs.cmvn)}), naming this split's own utt2spk "
                         "or cmvn.scp")


def read_table(kaldiio: Any, source: str, flag: str, fix: str) -> Iterator[tuple[str, Any]]:
    """The ``(key, value)`` pairs of the Kaldi table ``source`` (the value of ``flag``).

    kaldiio reports a damaged archive with a bare ``Exception`` ("File format is wrong?"), an
    ``AssertionError`` (an scp offset past the end) or a ``FileNotFoundError`` naming only the
    archive an scp points at: any of them becomes one ``ValueError`` naming the flag, the
    table and ``fix``. Errors raised by the caller's loop body are not touched.

    Raises:
        ValueError: If the table cannot be read.
    """
    rspec = rspecifier(source)
    try:
        with kaldiio.ReadHelper(rspec) as reader:
            yield from reader
    except Exception as err:  # noqa: BLE001 - kaldiio's errors have no common class
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = (f" (its relative paths are taken from the current directory, {os.getcwd()})"
                 if rspec.startswith("scp") else "")
        raise ValueError(f"{flag} {source} cannot be read as a Kaldi table ({reason}); "
                         f"{fix}{where}") from None


def check_out(out: str | os.PathLike[str], overwrite: bool) -> None:
    """Refuse an ``--out`` that is a directory, in no directory, or there (unless ``overwrite``).

    Raises:
        ValueError: Naming ``--out`` and the fix.
    """
    path = Path(out)
    if path.is_dir():
        raise ValueError(f"--out {path} is a directory; name the .h5 file to write")
    if not path.parent.is_dir():
        raise ValueError(f"--out {path}: directory {path.parent} does not exist; create it or "
                         "write elsewhere")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise ValueError(f"--out {path} already exists; pass --overwrite to replace it, or "
                         "write elsewhere")


def checked_norm(mean: np.ndarray, std: np.ndarray, where: Path) -> tuple[np.ndarray, np.ndarray]:
    """``--norm-from``'s statistics as float32, if they can normalise a frame.

    Raises:
        ValueError: For vectors of different shapes, or a non-finite mean or a std not > 0
            (every normalised frame would be NaN or infinite).
    """
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    if mean.ndim != 1 or mean.shape != std.shape or not len(mean):
        raise ValueError(f"{where}: 'mean' and 'std' must be vectors of one length, got shapes "
                         f"{list(mean.shape)} and {list(std.shape)}; save the statistics of "
                         "one feature dimension each")
    if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
        raise ValueError(f"{where}: 'mean' must be finite and 'std' finite and > 0 in every "
                         "dimension (a NaN or a zero std makes every frame NaN or infinite); "
                         "recompute the statistics, or use the training file's (--like)")
    return mean, std
