"""speechocean762 as Kaldi data directories: utterances, the split by speaker, the lexicon.

The corpus (Zhang et al., Interspeech 2021; https://github.com/jimbozhang/speechocean762, free
for commercial and non-commercial use) is 5,000 read English sentences by 250 non-native
speakers, 16 kHz, in two Kaldi data directories split by speaker: ``train/`` (125 speakers,
2,500 utterances) and ``test/`` (125, 2,500), each with ``text``, ``wav.scp`` (paths relative
to the corpus root) and ``utt2spk``. ``resource/lexicon.txt`` is a 2,861-word ARPAbet
lexicon with stress digits. 245 WAVs under ``WAVE/SPEAKER96xx`` have no transcript: no data
directory lists them, so they are never read.

Some training speakers are held out as a development set (``dev``): the acoustic scale and
beam are chosen on it, never on ``test``.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
import wave
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
"""The corpus's sampling rate (Hz)."""
SPLITS = ("train", "test")
"""The corpus's own data directories."""
ARCHIVED = ("WAVE", "train", "test", "resource/lexicon.txt", "resource/text-phone")
"""What ``git archive`` takes from the corpus's repository (all of ``resource/`` fails: its
pronunciation-score files are absent from the snapshot, and not needed)."""
_STRESS = re.compile(r"(?<=[A-Z])[0-2]$")


class CorpusError(ValueError):
    """The corpus directory is missing or malformed; the message names the file and the fix."""


@dataclass(frozen=True)
class Utterance:
    """One recording and its transcript.

    Attributes:
        utt_id: The corpus's utterance id (``000010011``).
        speaker: The speaker id (``0001``).
        words: The transcript, upper case as the corpus writes it.
        wav: The WAV file's path.
    """

    utt_id: str
    speaker: str
    words: tuple[str, ...]
    wav: Path


def _table(path: Path) -> dict[str, str]:
    """A Kaldi table file: ``key rest-of-line`` per line (tab or space separated)."""
    if not path.is_file():
        raise CorpusError(f"{path} not found; pass the directory the corpus was extracted to "
                          "(it holds train/, test/, WAVE/ and resource/)")
    out: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.strip().split(maxsplit=1)
        if not fields:
            continue
        if len(fields) != 2 or fields[0] in out:
            raise CorpusError(f"{path}:{number}: expected a new 'key value' line, got {line!r}")
        out[fields[0]] = fields[1].strip()
    return out


def corpus_root(source: Path, scratch: Path) -> Path:
    """The extracted corpus: ``source`` itself, or ``source`` (a git dir) extracted.

    Args:
        source: The directory the corpus was extracted to, or the corpus repository's git
            directory (bare, e.g. a mirror), which is then extracted with ``git archive``.
        scratch: Where a git directory is extracted to (``scratch/speechocean762``); an
            extraction already there is reused.

    Raises:
        CorpusError: If ``source`` is neither, or the extraction fails.
    """
    if (source / "train" / "text").is_file():
        return source
    if not ((source / "HEAD").is_file() and (source / "objects").is_dir()):
        raise CorpusError(f"{source} is neither an extracted speechocean762 (train/text) nor "
                          "its git directory; pass one of them")
    dest = scratch / "speechocean762"
    if (dest / "train" / "text").is_file() and (dest / "WAVE").is_dir():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        done = subprocess.run(["git", f"--git-dir={source}", "archive", "HEAD", *ARCHIVED],
                              stdout=tar, stderr=subprocess.PIPE, check=False)
        if done.returncode:
            raise CorpusError(f"git archive of {source} failed: "
                              f"{done.stderr.decode(errors='replace').strip()}")
        tar.seek(0)
        with tarfile.open(fileobj=tar) as archive:
            archive.extractall(dest, filter="data")
    return dest


def read_split(root: Path, split: str) -> list[Utterance]:
    """The utterances of one data directory (``train`` or ``test``), in utterance-id order.

    Only utterances with a transcript, a WAV and a speaker are kept.

    Raises:
        CorpusError: If a file is missing or malformed, or a listed WAV does not exist.
    """
    folder = root / split
    text, wavs, spks = (_table(folder / name) for name in ("text", "wav.scp", "utt2spk"))
    out = []
    for utt_id in sorted(set(text) & set(wavs) & set(spks)):
        wav = root / wavs[utt_id]
        if not wav.is_file():
            raise CorpusError(f"{folder / 'wav.scp'}: {utt_id}'s {wav} does not exist; "
                              "extract WAVE/ too")
        out.append(Utterance(utt_id, spks[utt_id], tuple(text[utt_id].split()), wav))
    return out


def hold_out_speakers(utts: Sequence[Utterance], count: int,
                      seed: int = 0) -> tuple[list[Utterance], list[Utterance]]:
    """Split utterances by speaker: ``count`` speakers drawn with ``seed`` go to the second list.

    Raises:
        ValueError: If fewer than ``count + 1`` speakers are there.
    """
    speakers = sorted({u.speaker for u in utts})
    if not 0 <= count < len(speakers):
        raise ValueError(f"cannot hold out {count} of {len(speakers)} speakers")
    rng = np.random.default_rng(seed)
    held = set(rng.choice(speakers, size=count, replace=False).tolist()) if count else set()
    return ([u for u in utts if u.speaker not in held], [u for u in utts if u.speaker in held])


def subset(utts: Sequence[Utterance], limit: int | None, seed: int = 0) -> list[Utterance]:
    """At most ``limit`` utterances drawn with ``seed`` across all speakers (id order kept)."""
    if limit is None or limit >= len(utts):
        return list(utts)
    keep = np.random.default_rng(seed).choice(len(utts), size=limit, replace=False)
    return [utts[i] for i in sorted(keep.tolist())]


def strip_stress(phone: str) -> str:
    """``AH0`` -> ``AH``: the lexicon's ARPAbet without stress digits."""
    return _STRESS.sub("", phone)


def read_lexicon(path: Path) -> dict[str, list[tuple[str, ...]]]:
    """``word -> pronunciations`` of a ``word phone phone ...`` lexicon, stress digits removed.

    A word's pronunciations are kept in file order, each once (two that differ only in
    stress become one).

    Raises:
        CorpusError: If the file is missing or a line has no phone.
    """
    if not path.is_file():
        raise CorpusError(f"{path} not found; extract resource/lexicon.txt with the corpus")
    lexicon: dict[str, list[tuple[str, ...]]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 2:
            raise CorpusError(f"{path}:{number}: a word without phones: {line!r}")
        pron = tuple(strip_stress(p) for p in fields[1:])
        prons = lexicon.setdefault(fields[0], [])
        if pron not in prons:
            prons.append(pron)
    return lexicon


def vocabulary(utts: Iterable[Utterance]) -> Counter[str]:
    """Word counts of the transcripts."""
    return Counter(w for u in utts for w in u.words)


def oov_rate(utts: Iterable[Utterance], vocab: Iterable[str]) -> tuple[int, int]:
    """``(tokens not in vocab, tokens)`` of the transcripts."""
    known = set(vocab)
    counts = vocabulary(utts)
    return sum(c for w, c in counts.items() if w not in known), sum(counts.values())


def write_text(utts: Iterable[Utterance], path: Path) -> None:
    """A Kaldi ``text`` file of the transcripts (``utt word word ...``)."""
    path.write_text("".join(f"{u.utt_id} {' '.join(u.words)}\n" for u in utts),
                    encoding="utf-8")


def read_wav(path: Path) -> bytes:
    """The 16-bit mono 16 kHz PCM samples of a WAV file, as bytes.

    Raises:
        CorpusError: If the file is not 16-bit mono at 16 kHz.
    """
    with wave.open(str(path), "rb") as wav:
        if (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) != (SAMPLE_RATE, 1, 2):
            raise CorpusError(f"{path}: expected 16-bit mono at {SAMPLE_RATE} Hz, got "
                              f"{wav.getsampwidth() * 8}-bit, {wav.getnchannels()} channel(s) "
                              f"at {wav.getframerate()} Hz")
        return wav.readframes(wav.getnframes())
