"""Frame labels by forced alignment with pocketsphinx's en-us model, cached, on two processes.

Each utterance is aligned to its transcript as pocketsphinx 5 does it:
``Decoder(samprate=16000, bestpath=False, maxhmmpf=-1, maxwpf=-1)`` (no pruning; the default
``bestpath=True`` failed 55 of 200 training utterances), ``set_align_text`` and a first
decode (word segmentation), ``set_alignment`` and a second decode (phone and state
segmentation), then ``get_alignment()``: words (with the optional ``<sil>`` between them),
each word's phones, each phone's three HMM states with their frames (10 ms) and tied-state
(senone) ids. About 0.7 % of the utterances fail so ("Failed to set up sub-word
alignment"; which ones depends on what the decoder saw before: its live cepstral mean); each
is tried again in a fresh decoder with wider beams (:data:`FALLBACKS`), which aligns most of
them. A transcript word missing from pocketsphinx's dictionary is added with its
first pronunciation in ``resource/lexicon.txt`` (stress digits removed).

Alignments are kept in a JSON-lines cache (one object per utterance, appended as each is
done), so a rebuild, or a build interrupted and started again, aligns only what is new.
About 0.2 s an utterance on one core; :func:`align_all` uses the calling process and at most
one worker process (``jobs=2``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from examples.speechocean.corpus import Utterance, read_wav
from examples.speechocean.phones import SILENCE_CLASSES, state_class

BATCH = 20
"""Utterances per unit of work handed to the worker process."""
CONFIG = {"samprate": 16000, "bestpath": False, "maxhmmpf": -1, "maxwpf": -1,
          "loglevel": "FATAL"}
"""The decoder's settings."""
FALLBACKS = ({"beam": 1e-80, "wbeam": 1e-60, "pbeam": 1e-80}, {})
"""Settings added to :data:`CONFIG` for a fresh decoder when an alignment fails, in turn."""


@dataclass
class Alignment:
    """One utterance's forced alignment (frames of 10 ms from the start of the file).

    Attributes:
        utt_id: The utterance.
        frames: Frames pocketsphinx saw.
        words: ``[word, first frame, frames]`` per word, ``<sil>`` included.
        states: ``[phone, state (0-2), senone, first frame, frames]`` per HMM state.
        seconds: The time both decodes took.
        error: Why it failed (``words`` and ``states`` then empty), or ``None``.
        attempts: Decoders tried (1 + fallbacks; 0 in a cache older than the fallbacks).
    """

    utt_id: str
    frames: int = 0
    words: list[list[Any]] = field(default_factory=list)
    states: list[list[Any]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    attempts: int = 0


_DECODER = None  # one per process, made by _start
_EXTRA: dict[str, str] = {}


def _decoder(extra: dict[str, str], **settings: float) -> Any:
    """A decoder with :data:`CONFIG` and ``settings``, knowing the words in ``extra``."""
    from pocketsphinx import Decoder

    decoder = Decoder(**CONFIG, **settings)
    for number, (word, phones) in enumerate(sorted(extra.items()), start=1):
        decoder.add_word(word, phones, number == len(extra))
    return decoder


def _start(extra: dict[str, str]) -> None:
    """Make this process's decoder and add the words pocketsphinx's dictionary lacks."""
    global _DECODER, _EXTRA
    _EXTRA = dict(extra)
    _DECODER = _decoder(_EXTRA)


def missing_words(words: Iterable[str],
                  lexicon: dict[str, list[tuple[str, ...]]]) -> dict[str, str]:
    """``word -> "PH ON ES"`` for the (lower-cased) words pocketsphinx's dictionary lacks.

    Raises:
        KeyError: For a word neither dictionary has.
    """
    from pocketsphinx import Decoder

    probe = Decoder(samprate=16000, loglevel="FATAL")
    out = {}
    for word in sorted(set(words)):
        if probe.lookup_word(word.lower()) is None:
            out[word.lower()] = " ".join(lexicon[word][0])
    return out


def _align_with(decoder: Any, utt_id: str, audio: bytes, words: Sequence[str]) -> Alignment:
    """Both decodes of one utterance with ``decoder``; a failure is recorded, not raised."""
    try:
        decoder.set_align_text(" ".join(w.lower() for w in words))
        for first in (True, False):
            if not first:
                decoder.set_alignment()
            decoder.start_utt()
            decoder.process_raw(audio, full_utt=True)
            decoder.end_utt()
        result = decoder.get_alignment()
        if result is None:
            raise RuntimeError("no alignment")
        out = Alignment(utt_id, frames=decoder.n_frames())
        for word in result:
            out.words.append([word.name, word.start, word.duration])
            for phone in word:
                for k, state in enumerate(phone):
                    out.states.append([phone.name, k, int(state.name), state.start,
                                       state.duration])
    except Exception as err:  # noqa: BLE001 - pocketsphinx raises RuntimeError, or worse
        out = Alignment(utt_id, error=f"{type(err).__name__}: {err}")
    return out


def align_one(utt_id: str, wav: Path, words: Sequence[str]) -> Alignment:
    """Align one utterance with this process's decoder (:func:`_start` first), then fallbacks."""
    assert _DECODER is not None, "call _start first"
    start = time.perf_counter()
    audio = read_wav(wav)
    out = _align_with(_DECODER, utt_id, audio, words)
    out.attempts = 1
    for settings in FALLBACKS if out.error else ():
        out = _align_with(_decoder(_EXTRA, **settings), utt_id, audio, words)
        out.attempts = 1 + FALLBACKS.index(settings) + 1
        if out.error is None:
            break
    out.seconds = round(time.perf_counter() - start, 4)
    return out


def _align_batch(batch: list[tuple[str, str, tuple[str, ...]]]) -> list[Alignment]:
    return [align_one(utt_id, Path(wav), words) for utt_id, wav, words in batch]


class AlignmentCache:
    """Alignments by utterance id, read from and appended to a JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: dict[str, Alignment] = {}
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():  # a line cut short by an interrupted build is skipped
                    try:
                        item = Alignment(**json.loads(line))
                    except (json.JSONDecodeError, TypeError):
                        continue
                    self.items[item.utt_id] = item

    def add(self, items: Iterable[Alignment]) -> None:
        """Keep ``items`` and append them to the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as out:
            for item in items:
                self.items[item.utt_id] = item
                out.write(json.dumps(asdict(item)) + "\n")


def align_all(utts: Sequence[Utterance], lexicon: dict[str, list[tuple[str, ...]]],
              cache: AlignmentCache, jobs: int = 2,
              progress: Callable[[int, int], None] | None = None) -> dict[str, Alignment]:
    """Align every utterance the cache lacks (or failed before the fallbacks); returns theirs.

    Args:
        utts: The utterances.
        lexicon: The corpus lexicon (for words pocketsphinx lacks).
        cache: Where alignments are read from and added to.
        jobs: 1 (this process only) or 2 (this one and one worker process).
        progress: Called with (done, to do) after each batch.
    """
    tries = 1 + len(FALLBACKS)
    todo = [(u.utt_id, str(u.wav), u.words) for u in utts
            if u.utt_id not in cache.items
            or (cache.items[u.utt_id].error and cache.items[u.utt_id].attempts < tries)]
    if todo:
        extra = missing_words((w for u in utts for w in u.words), lexicon)
        batches = [todo[i:i + BATCH] for i in range(0, len(todo), BATCH)]
        done = 0

        def keep(items: list[Alignment]) -> None:
            nonlocal done
            cache.add(items)
            done += len(items)
            if progress:
                progress(done, len(todo))

        _start(extra)
        if jobs < 2:
            for batch in batches:
                keep(_align_batch(batch))
        else:
            with ProcessPoolExecutor(1, initializer=_start, initargs=(extra,)) as pool:
                theirs: list[Future[list[Alignment]]] = [pool.submit(_align_batch, b)
                                                         for b in batches[1::2]]
                for batch in batches[0::2]:
                    keep(_align_batch(batch))
                    for future in [f for f in theirs if f.done()]:
                        theirs.remove(future)
                        keep(future.result())
                for future in theirs:
                    keep(future.result())
    return {u.utt_id: cache.items[u.utt_id] for u in utts}


def frame_labels(alignment: Alignment, frames: int) -> np.ndarray:
    """``[frames]`` int32 phone-state classes of an alignment, for ``frames`` feature frames.

    pocketsphinx's frame ``t`` and Kaldi's (``snip_edges``) both start at sample 160 t, so
    they are the same frame; pocketsphinx counts one or two more at the end (a window that
    runs past the file), which are dropped. A frame it did not label is silence.
    """
    labels = np.full(frames, SILENCE_CLASSES[0], np.int32)
    for phone, k, _senone, start, length in alignment.states:
        labels[start:start + length] = state_class(phone, k)
    return labels


def word_spans(alignment: Alignment) -> list[tuple[str, int, int]]:
    """``(word, first frame, end frame)`` of the words spoken (``<sil>`` and fillers left out)."""
    return [(w, s, s + n) for w, s, n in alignment.words
            if not (w.startswith("<") or w.startswith("["))]
