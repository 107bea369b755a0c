"""The speechocean762 builder (examples/speechocean) on made-up inputs.

A three-word lexicon, a corpus of five made-up speakers, fake alignments and made-up
log-likelihoods: none of it needs the corpus. Two tests need pocketsphinx and are skipped
without it: a tone through the aligner, and the whole command (it checks for pocketsphinx
first) over alignments put in its cache beforehand.
"""

from __future__ import annotations

import math
import wave
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kaldifst")
pytest.importorskip("kaldi_decoder")

from examples.speechocean import corpus, graph, lm, phones  # noqa: E402
from examples.speechocean.align import Alignment, AlignmentCache, frame_labels  # noqa: E402
from hadpsgd.decode.search import Decoder  # noqa: E402
from hadpsgd.decode.user_graph import load_graph  # noqa: E402

LEXICON = {"CAT": [("K", "AE", "T")], "DOG": [("D", "AO", "G")], "AT": [("AE", "T")]}
SENTENCES = [("CAT", "AT", "DOG"), ("DOG", "AT", "CAT"), ("CAT", "DOG"), ("DOG",)]


def _wav(path: Path, seconds: float, freq: float) -> None:
    t = np.arange(int(seconds * 16000)) / 16000
    samples = (8000 * np.sin(2 * np.pi * freq * t)).astype("<i2")
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())


def _made_up_corpus(root: Path) -> None:
    """Two splits of two speakers each, three utterances a speaker, one WAV without text."""
    for split, speakers in (("train", ("0001", "0002", "0003", "0004")), ("test", ("0005",))):
        text, scp, spk = [], [], []
        for s in speakers:
            for u in range(3):
                utt = f"{s}{u:05d}"
                wav = f"WAVE/SPEAKER{s}/{utt}.WAV"
                _wav(root / wav, 0.5, 200 + 50 * u)
                words = " ".join(SENTENCES[u])
                text.append(f"{utt}\t{words}")
                scp.append(f"{utt}\t{wav}")
                spk.append(f"{utt} {s}")
        (root / split).mkdir(parents=True)
        for name, lines in (("text", text[:-1]), ("wav.scp", scp), ("utt2spk", spk)):
            (root / split / name).write_text("\n".join(lines) + "\n")


def test_the_split_is_by_speaker_and_untranscribed_wavs_are_ignored(tmp_path):
    _made_up_corpus(tmp_path)
    train = corpus.read_split(tmp_path, "train")
    assert len(train) == 11  # 12 WAVs listed, one without a transcript
    assert corpus.corpus_root(tmp_path, tmp_path / "scratch") == tmp_path
    kept, dev = corpus.hold_out_speakers(train, 2, seed=3)
    assert len({u.speaker for u in dev}) == 2
    assert not {u.speaker for u in kept} & {u.speaker for u in dev}
    assert sorted(u.utt_id for u in kept + dev) == sorted(u.utt_id for u in train)
    again, _ = corpus.hold_out_speakers(train, 2, seed=3)
    assert again == kept
    test = corpus.read_split(tmp_path, "test")
    assert not {u.speaker for u in test} & {u.speaker for u in train}
    assert corpus.subset(train, 4, seed=0) == corpus.subset(train, 4, seed=0)
    assert len(corpus.subset(train, 4)) == 4


def test_lexicon_stress_digits_are_removed(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_text("A\tAH0\nA\tEY0\nA\tAH1\nABILITY\tAH0 B IH1 L AH0 T IY0\n")
    lex = corpus.read_lexicon(path)
    assert lex == {"A": [("AH",), ("EY",)], "ABILITY": [("AH", "B", "IH", "L", "AH", "T", "IY")]}


def test_the_lm_sums_to_one_for_every_history():
    model = lm.BigramLM.estimate(SENTENCES, [*LEXICON, "EMU"])
    targets = [*model.vocab, lm.EOS]
    for history in [lm.BOS, *model.vocab]:
        total = sum(model.prob(w, history) for w in targets)
        assert math.isclose(total, 1.0, rel_tol=1e-12), (history, total)
    # A word never seen in training still has a probability; a seen bigram is likelier.
    assert model.prob("EMU", "CAT") > 0
    assert model.prob("AT", "CAT") > model.prob("CAT", "CAT")
    assert math.isclose(sum(model.p_unigram(w) for w in targets), 1.0)


def test_fake_alignment_labels_and_cache(tmp_path):
    ali = Alignment("u1", frames=12, words=[["<sil>", 0, 3], ["at", 3, 9]],
                    states=[["SIL", 0, 96, 0, 1], ["SIL", 1, 97, 1, 1], ["SIL", 2, 98, 2, 1],
                            ["AE", 0, 5, 3, 2], ["AE", 1, 6, 5, 2], ["AE", 2, 7, 7, 1],
                            ["T", 0, 8, 8, 2], ["T", 1, 9, 10, 1], ["T", 2, 10, 11, 1]])
    labels = frame_labels(ali, 11)  # pocketsphinx saw one frame more than the features
    assert labels.tolist() == [0, 1, 2, 6, 6, 7, 7, 8, 93, 93, 94]
    assert [phones.class_name(c) for c in (6, 93)] == ["AE_0", "T_0"]
    cache = AlignmentCache(tmp_path / "a.jsonl")
    cache.add([ali, Alignment("u2", error="RuntimeError: no alignment")])
    again = AlignmentCache(tmp_path / "a.jsonl")
    assert again.items["u1"] == ali and again.items["u2"].error


def _frames(sequence: list[tuple[int, int]]) -> np.ndarray:
    """Log-likelihoods that favour each (class, frames) run by 3 nats."""
    rows = [c for c, n in sequence for _ in range(n)]
    out = np.full((len(rows), phones.NUM_CLASSES), -3.0, np.float32)
    out[np.arange(len(rows)), rows] = 0.0
    return out


def _spoken(words: list[str], silence_between: bool) -> list[tuple[int, int]]:
    runs = [(c, 4) for c in phones.SILENCE_CLASSES]
    for w in words:
        runs += [(phones.state_class(p, k), 3) for p in LEXICON[w][0] for k in range(3)]
        if silence_between:
            runs += [(c, 2) for c in phones.SILENCE_CLASSES]
    return runs


def test_the_graph_decodes_made_up_loglikelihoods_to_the_words(tmp_path):
    model = lm.BigramLM.estimate(SENTENCES, LEXICON)
    loops = np.full(phones.NUM_CLASSES, 0.6)
    hclg, syms = graph.build_hclg(LEXICON, model, loops)
    path = tmp_path / "HCLG.fst"
    hclg.write(str(path))
    graph.write_words(syms, tmp_path / "words.txt")
    user = load_graph(path, tmp_path / "words.txt").fitted(phones.NUM_CLASSES)
    decoder = Decoder(user, acoustic_scale=1.0, beam=30)
    # "AT" is a suffix of "CAT": only the acoustics tell "CAT" from "AT" after a word.
    for words, gaps in ((["CAT", "AT", "DOG"], True), (["DOG", "AT", "CAT"], False),
                        (["AT"], True), (["DOG", "DOG", "CAT"], False)):
        hyp = decoder.decode(_frames(_spoken(words, gaps)))
        assert list(hyp.words) == words and hyp.reached_final


def test_homophones_and_prefixes_get_disambiguation_symbols():
    lex = {"RED": [("R", "EH", "D")], "READ": [("R", "EH", "D"), ("R", "IY", "D")],
           "RE": [("R", "EH")], "X": [("EH", "K", "S")]}
    marks = {(w, p): k for w, p, k in graph.disambiguate(lex)}
    assert marks[("READ", ("R", "EH", "D"))] != marks[("RED", ("R", "EH", "D"))]
    assert marks[("RE", ("R", "EH"))] > 0 and marks[("X", ("EH", "K", "S"))] == 0
    syms = graph.symbols(lex)
    assert syms.phone_disambig["#0"] == len(phones.PHONES) + 1 and "#2" in syms.phone_disambig


def test_pocketsphinx_aligns_a_tone_without_crashing(tmp_path):
    pytest.importorskip("pocketsphinx")
    from examples.speechocean import align

    _wav(tmp_path / "a.wav", 1.0, 300)
    align._start({})
    result = align.align_one("a", tmp_path / "a.wav", ["CAT"])
    if result.error is None:  # a tone may or may not align; if it does, it is well formed
        labels = frame_labels(result, 98)
        assert labels.min() >= 0 and labels.max() < phones.NUM_CLASSES
        assert [w for w, _, _ in align.word_spans(result)] == ["cat"]


def _fake_alignment(utt_id: str, words: tuple[str, ...], frames: int) -> Alignment:
    """Silence, then each word's phones' states, frames shared out evenly."""
    states = [("SIL", k) for k in range(3)]
    states += [(p, k) for w in words for p in LEXICON[w][0] for k in range(3)]
    cuts = np.linspace(0, frames, len(states) + 1).astype(int)
    return Alignment(utt_id, frames=frames, words=[["<sil>", 0, int(cuts[3])]],
                     states=[[p, k, 0, int(a), int(b - a)]
                             for (p, k), a, b in zip(states, cuts[:-1], cuts[1:], strict=True)],
                     attempts=1)


def test_the_command_builds_every_set_and_a_graph_from_cached_alignments(tmp_path):
    pytest.importorskip("pocketsphinx")  # the command checks for it before anything else
    pytest.importorskip("kaldi_native_fbank")
    import h5py

    from examples.speechocean import build

    root, out = tmp_path / "corpus", tmp_path / "out"
    _made_up_corpus(root)
    (root / "resource").mkdir()
    (root / "resource" / "lexicon.txt").write_text(
        "".join(f"{w}\t{' '.join(p + '1' for p in LEXICON[w][0])}\n" for w in LEXICON))
    cache = AlignmentCache(out / "align.jsonl")
    for split in corpus.SPLITS:
        cache.add(_fake_alignment(u.utt_id, u.words, 50)
                  for u in corpus.read_split(root, split))
    assert build.main([str(root), str(out), "--dev-speakers", "1"]) == 0
    with h5py.File(out / "train.h5") as train, h5py.File(out / "dev.h5") as dev:
        assert train.attrs["num_classes"] == phones.NUM_CLASSES
        assert list(train.attrs["silence_classes"]) == [0, 1, 2]
        assert len(train["utt_ids"]) + len(dev["utt_ids"]) == 11
        assert train["feats"].shape[1] == 120
    assert len((out / "test.text").read_text().splitlines()) == 2  # one WAV has no text
    report = __import__("json").loads((out / "build.json").read_text())
    assert report["graph"]["words"] == 3 and report["alignment"]["failed"] == 0
    user = load_graph(out / "HCLG.fst", out / "words.txt").fitted(phones.NUM_CLASSES)
    hyp = Decoder(user, acoustic_scale=1.0, beam=30).decode(
        _frames(_spoken(["DOG", "AT", "CAT"], True)))
    assert list(hyp.words) == ["DOG", "AT", "CAT"]
