"""The training import's transformations, redone on raw Kaldi features or refused.

The Kaldi import records what it did to the features (:mod:`hadpsgd.data.pipeline`); the
checkpoint names its training file (``config.data.train``), as it does for the file's
``norm/`` statistics. Raw Kaldi features (``--features scp:feats.scp``) get the same CMVN
here, from ``--utt2spk`` (statistics computed per speaker over the table, as at import) or
Kaldi's ``--cmvn scp:cmvn.scp``, or the forward pass refuses, naming what is missing and the
flag that gives it. An ``.h5`` input carries its own import's work: it is refused only if its
record says another CMVN than the training file's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hadpsgd.data.cmvn import COMPUTED, PER_SPEAKER, Cmvn, CmvnError, read_utt2spk
from hadpsgd.data.kaldi_plan import rspecifier
from hadpsgd.data.pipeline import CmvnRecord, ImportRecord, cmvn_mismatch, read_record
from hadpsgd.forward.model import ForwardError

APPLIED = "applied"
"""``--cmvn applied``: the features given had the training import's CMVN already."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--utt2spk`` and ``--cmvn``, the CMVN flags of Kaldi input."""
    parser.add_argument("--utt2spk", default=None, metavar="FILE",
                        help="Kaldi input whose training import had per-speaker CMVN: these "
                             "features' utt2spk (statistics per speaker over the table, as "
                             "the import did)")
    parser.add_argument("--cmvn", default=None, metavar="RSPECIFIER|applied",
                        help="Kaldi's CMVN statistics of these features (scp:cmvn.scp; by "
                             "speaker with --utt2spk, by utterance without) instead of "
                             "computing them; 'applied': the features had the import's CMVN "
                             "already")


def training_record(train_file: str | None, norm: str) -> tuple[ImportRecord | None, str]:
    """The import record of the model's training file, and the file (or why there is none).

    The training file the checkpoint names comes first; where it is not here, ``--norm
    FILE.h5`` (the training file by another path) stands in for it.

    Raises:
        ForwardError: For a record this hadpsgd cannot read.
    """
    candidates = [c for c in (train_file, norm) if c is not None and c not in ("auto", "none")
                  and c.endswith((".h5", ".hdf5")) and Path(c).is_file()]
    if not candidates:
        where = (f"the training file {train_file} is not here" if train_file else
                 "the run trained on the synthetic set")
        return None, where
    try:
        return read_record(candidates[0]), candidates[0]
    except (ValueError, OSError) as err:
        raise ForwardError(f"{err}") from None


def check_h5(spec: str, train: ImportRecord | None, where: str) -> None:
    """Refuse an ``.h5`` input imported with another CMVN than the training file.

    Raises:
        ForwardError: Naming both CMVNs and the import flags to use.
    """
    if train is None:
        return
    try:
        problem = cmvn_mismatch(where, spec)
    except (ValueError, OSError) as err:
        raise ForwardError(f"--features {err}") from None
    if problem is not None:
        raise ForwardError(f"--features {problem}")


def plan(spec: str, train: ImportRecord | None, where: str, utt2spk: str | None,
         cmvn: str | None, kaldiio: Any) -> tuple[Cmvn | None, str]:
    """The CMVN to redo on the Kaldi features ``spec``, and one phrase saying which.

    Args:
        spec: The ``--features`` rspecifier.
        train: The training file's import record (None: not known).
        where: The training file, or why there is none (:func:`training_record`).
        utt2spk: ``--utt2spk``.
        cmvn: ``--cmvn`` (an rspecifier, ``applied``, or None).
        kaldiio: The kaldiio module.

    Raises:
        ForwardError: For a CMVN the record asks for and the flags do not give, or flags the
            record does not ask for; the message names the training file and the flag.
    """
    flags = " ".join(f for f, v in (("--utt2spk", utt2spk), ("--cmvn", cmvn)) if v)
    if train is None:
        if flags:
            raise ForwardError(f"{flags}: nothing records which CMVN the model's training "
                               f"features had ({where}, or it was not written by python -m "
                               "hadpsgd.data.kaldi), so forward cannot redo it; drop "
                               f"{flags}, or give the training file with --norm TRAIN.h5")
        return None, f"no CMVN (nothing recorded: {where})"
    note = ""
    if train.features_command and not spec.rstrip().endswith("|"):
        note = (f" (the training features were read through a command, {train.features!r}: "
                "give --features the same command over these features)")
    recorded = train.cmvn
    if recorded is None:
        if flags:
            raise ForwardError(f"{flags}: the model's training file {where} was imported "
                               f"without CMVN ({train.features}); drop {flags}")
        return None, f"no CMVN, as the import of {where}{note}"
    if cmvn == APPLIED:
        if utt2spk:
            raise ForwardError("--cmvn applied says the features were normalised already; "
                               "drop --utt2spk")
        return None, f"{recorded.describe()} already applied (--cmvn applied){note}"
    if recorded.per == PER_SPEAKER and utt2spk is None:
        raise ForwardError(
            f"the model's training file {where} was imported with {recorded.describe()} "
            f"(speakers from {recorded.utt2spk}), and --features {spec} are used as given: "
            f"pass --utt2spk with these features' utt2spk (e.g. data/test/utt2spk) to redo "
            f"it, optionally with --cmvn scp:data/test/cmvn.scp for Kaldi's statistics, or "
            f"--cmvn applied if {spec} had it already")
    if recorded.per != PER_SPEAKER and utt2spk is not None:
        raise ForwardError(f"--utt2spk: the model's training file {where} was imported with "
                           f"{recorded.describe()}, not per speaker; drop --utt2spk")
    stats = rspecifier(cmvn) if cmvn else COMPUTED
    redo = CmvnRecord(recorded.per, recorded.norm_vars, stats, utt2spk)
    try:
        speakers = read_utt2spk(utt2spk) if utt2spk is not None else None
        applier = Cmvn(recorded.per, recorded.norm_vars, speakers, stats, kaldiio)
    except CmvnError as err:
        raise ForwardError(f"{'--cmvn' if cmvn else '--utt2spk'}: {err}") from None
    if applier.needs_pass and kaldiio.utils.parse_specifier(spec)["ark"] == "-":
        raise ForwardError(f"--features {spec}: per-speaker CMVN reads the features twice "
                           "(the speakers' statistics, then the frames), and standard input "
                           "is read once; write the features to a file or an scp, or pass "
                           "Kaldi's statistics with --cmvn scp:cmvn.scp")
    return applier, f"{redo.describe()}, as the import of {where}{note}"


def prepare(cmvn: Cmvn, utt: str, mat: Any) -> Any:
    """``mat`` with its CMVN, a missing speaker or statistics as a :class:`ForwardError`."""
    try:
        return cmvn.apply(utt, mat)
    except CmvnError as err:
        raise ForwardError(f"--features: {err}") from None
