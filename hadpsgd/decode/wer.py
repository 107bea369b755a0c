"""Scoring with kaldialign: word and sentence error rates, references, Kaldi text files.

The word error rate is Kaldi's ``compute-wer``: per utterance the edit distance (fewest
substitutions + deletions + insertions) between reference and hypothesis, summed over the
corpus and divided by the number of reference words. The sentence error rate is the share of
utterances with at least one error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import kaldialign

Transcripts = dict[str, tuple[str, ...]]
"""Utterance id -> words."""

# The digit set's ids end in "-<digits>", e.g. ho003-en-gb+f3-012-4821 -> 4 8 2 1.
_TRAILING_DIGITS = re.compile(r"-(\d+)$")


class ReferencesError(ValueError):
    """References cannot be read, or do not cover the hypotheses; the message says the fix."""


def reference_from_utt_id(utt: str) -> tuple[str, ...]:
    """The digit words an utterance id ends with (``...-4821`` -> ``("4", "8", "2", "1")``).

    Raises:
        ReferencesError: If the id does not end in ``-`` and digits.
    """
    match = _TRAILING_DIGITS.search(utt)
    if not match:
        raise ReferencesError(f"utterance id {utt!r} does not end in '-<digits>', so it names "
                             "no reference; pass --refs FILE (a Kaldi text file) instead")
    return tuple(match.group(1))


def references_from_utt_ids(utts: Iterable[str]) -> Transcripts:
    """:func:`reference_from_utt_id` of every id."""
    return {utt: reference_from_utt_id(utt) for utt in utts}


def read_text(path: str | os.PathLike[str]) -> Transcripts:
    """A Kaldi ``text`` file: ``utterance word word ...`` per line (no words: empty).

    Raises:
        ReferencesError: If the file is missing or names an utterance twice.
    """
    path = Path(path)
    if not path.is_file():
        raise ReferencesError(f"reference file {path} not found; pass a Kaldi text file "
                             "('utterance word word ...' per line) or --refs utt-id")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ReferencesError(f"reference file {path} is not UTF-8 text ({err.reason} at byte "
                              f"{err.start}); pass a Kaldi text file ('utterance word word ...' "
                              "per line) or --refs utt-id") from None
    out: Transcripts = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if fields[0] in out:
            raise ReferencesError(f"{path}:{number}: utterance {fields[0]!r} appears twice; "
                                 "keep one line per utterance")
        out[fields[0]] = tuple(fields[1:])
    return out


def format_text(transcripts: Mapping[str, Sequence[str]]) -> str:
    """``transcripts`` as the contents of a Kaldi text file (``utt word ...`` per line)."""
    return "".join(" ".join([utt, *words]) + "\n" for utt, words in transcripts.items())


def write_text(path: str | os.PathLike[str], transcripts: Mapping[str, Sequence[str]]) -> None:
    """Write ``transcripts`` as a Kaldi text file, in the mapping's order."""
    Path(path).write_text(format_text(transcripts), encoding="utf-8")


@dataclass(frozen=True)
class UttScore:
    """One utterance's errors (kaldialign's minimum edit distance)."""

    utt: str
    ref_words: int
    ins: int
    dels: int
    subs: int

    @property
    def errors(self) -> int:
        """Insertions + deletions + substitutions."""
        return self.ins + self.dels + self.subs


@dataclass(frozen=True)
class Score:
    """Corpus totals of :func:`score`."""

    ref_words: int
    ins: int
    dels: int
    subs: int
    sentences: int
    sentence_errors: int
    missing: int = 0
    """References with no hypothesis (not scored)."""
    utterances: tuple[UttScore, ...] = field(default=(), repr=False)

    @property
    def errors(self) -> int:
        """Insertions + deletions + substitutions over the corpus."""
        return self.ins + self.dels + self.subs

    @property
    def wer(self) -> float:
        """Word error rate in percent (0 for no reference words and no errors, else inf)."""
        if self.ref_words == 0:
            return 0.0 if self.errors == 0 else float("inf")
        return 100.0 * self.errors / self.ref_words

    @property
    def ser(self) -> float:
        """Sentence error rate in percent."""
        return 100.0 * self.sentence_errors / self.sentences if self.sentences else 0.0

    def summary(self) -> str:
        """Kaldi ``compute-wer``'s three lines: %WER, %SER, and what was scored."""
        return (f"%WER {self.wer:.2f} [ {self.errors} / {self.ref_words}, {self.ins} ins, "
                f"{self.dels} del, {self.subs} sub ]\n"
                f"%SER {self.ser:.2f} [ {self.sentence_errors} / {self.sentences} ]\n"
                f"Scored {self.sentences} sentences, {self.missing} not present in hyp.")

    def to_dict(self) -> dict[str, object]:
        """Totals, rates and per-utterance errors, for ``--json``."""
        return {"wer": self.wer, "ser": self.ser, "errors": self.errors,
                "ref_words": self.ref_words, "ins": self.ins, "del": self.dels,
                "sub": self.subs, "sentences": self.sentences,
                "sentence_errors": self.sentence_errors, "missing": self.missing,
                "utterances": [asdict(u) for u in self.utterances]}


def score(refs: Mapping[str, Sequence[str]], hyps: Mapping[str, Sequence[str]]) -> Score:
    """Score every hypothesis against its reference.

    References without a hypothesis are counted in :attr:`Score.missing` and not scored
    (a text file may cover more utterances than were decoded), as ``compute-wer
    --mode=present`` does.

    Raises:
        ReferencesError: If a hypothesis has no reference (naming the first few).
    """
    lacking = [utt for utt in hyps if utt not in refs]
    if lacking:
        shown = ", ".join(lacking[:3]) + (" ..." if len(lacking) > 3 else "")
        raise ReferencesError(f"{len(lacking)} decoded utterance(s) have no reference ({shown}); "
                             "add them to the reference file or pass the matching one")
    rows = []
    for utt, hyp in hyps.items():
        ref = refs[utt]
        counts = kaldialign.edit_distance(list(ref), list(hyp))
        rows.append(UttScore(utt=utt, ref_words=len(ref), ins=int(counts["ins"]),
                             dels=int(counts["del"]), subs=int(counts["sub"])))
    return Score(ref_words=sum(r.ref_words for r in rows), ins=sum(r.ins for r in rows),
                 dels=sum(r.dels for r in rows), subs=sum(r.subs for r in rows),
                 sentences=len(rows), sentence_errors=sum(r.errors > 0 for r in rows),
                 missing=sum(utt not in hyps for utt in refs), utterances=tuple(rows))
