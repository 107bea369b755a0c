"""The digit decoder and scorer (hadpsgd.decode): graph, search, WER, input, command line."""

from __future__ import annotations

import json
import math

import h5py
import kaldi_decoder
import kaldifst
import kaldiio
import numpy as np
import pytest

from hadpsgd.decode.__main__ import main
from hadpsgd.decode.graph import (
    LEADING_SILENCE,
    SILENCE,
    START,
    build_graph,
    estimate_self_loop_probs,
    input_label,
    word_classes,
)
from hadpsgd.decode.loglikes import LoglikesError, LoglikesReader
from hadpsgd.decode.search import Decoder
from hadpsgd.decode.wer import (
    ReferencesError,
    read_text,
    reference_from_utt_id,
    references_from_utt_ids,
    score,
)

SIL = 30
ON, OFF = math.log(0.9), math.log(0.1 / 30)  # the "perfect" posteriors of the oracle check


def frames(*segments: tuple[int, int]) -> np.ndarray:
    """Log-posteriors [T, 31]: ``(class, n)`` is n frames of that class, ON there, OFF elsewhere."""
    classes = np.concatenate([np.full(n, c) for c, n in segments])
    out = np.full((len(classes), 31), OFF, dtype=np.float32)
    out[np.arange(len(classes)), classes] = ON
    return out


def digit(d: int, per_state: int = 4) -> list[tuple[int, int]]:
    return [(3 * d + k, per_state) for k in range(3)]


def arcs(fst: kaldifst.StdVectorFst, state: int) -> list[kaldifst.StdArc]:
    it = kaldifst.ArcIterator(fst, state)
    out = []
    while not it.done:
        out.append(it.value)
        it.next()
    return out


def is_final(fst: kaldifst.StdVectorFst, state: int) -> bool:
    return math.isfinite(float(fst.final(state).value))


# --- the decodable's label convention ---------------------------------------------------------

def test_decodable_reads_label_k_from_column_k_minus_1():
    # One frame through one arc per label 1..3: the label decoded is the column that wins + 1,
    # and log_likelihood(t, k) is matrix[t, k - 1]; label 0 is epsilon, never read.
    fst = kaldifst.StdVectorFst()
    start, end = fst.add_state(), fst.add_state()
    fst.start = start
    fst.set_final(end, 0.0)
    for label in (1, 2, 3):
        fst.add_arc(start, kaldifst.StdArc(label, 100 + label, 0.0, end))
    for column in range(3):
        matrix = np.full((1, 3), -10.0, dtype=np.float32)
        matrix[0, column] = 0.0
        decodable = kaldi_decoder.DecodableCtc(matrix)
        assert [decodable.log_likelihood(0, k) for k in (1, 2, 3)] == list(matrix[0])
        decoder = kaldi_decoder.FasterDecoder(fst, kaldi_decoder.FasterDecoderOptions(beam=20))
        decoder.decode(decodable)
        _, lattice = decoder.get_best_path()
        ok, ilabels, olabels, _ = kaldifst.get_linear_symbol_sequence(lattice)
        assert ok and ilabels == [column + 1] and olabels == [101 + column]
    assert input_label(0) == 1 and input_label(SIL) == 31


# --- the graph ---------------------------------------------------------------------------------

def test_word_classes_of_the_digit_set():
    groups = word_classes(31, 3, 30)
    assert groups == tuple((3 * d, 3 * d + 1, 3 * d + 2) for d in range(10))
    assert word_classes(7, 2, 0) == ((1, 2), (3, 4), (5, 6))
    with pytest.raises(ValueError, match="do not split"):
        word_classes(31, 4, 30)


def test_graph_size_and_labels():
    words, k = 10, 3
    graph = build_graph()
    fst = graph.fst
    # start, two silences, K states per word; arcs: start -> silence + W words, each silence
    # loop + W words, each word state a loop and a step, the last instead silence + W words.
    assert fst.num_states == 3 + words * k
    expected_arcs = (1 + words) + 2 * (1 + words) + words * (2 * (k - 1) + 1 + 1 + words)
    assert sum(len(arcs(fst, s)) for s in range(fst.num_states)) == expected_arcs == 193
    for s in range(fst.num_states):
        for arc in arcs(fst, s):
            assert arc.ilabel != 0  # epsilon-free: one frame per arc
            if arc.olabel:  # a word is output exactly where its first state is entered
                assert arc.ilabel == input_label(3 * (arc.olabel - 1))
                assert graph.word(arc.olabel) == str(arc.olabel - 1)
            else:
                assert (arc.ilabel - 1) % 3 != 0 or arc.ilabel - 1 == SIL or arc.nextstate == s


def test_graph_needs_a_word_and_silence_is_optional():
    fst = build_graph().fst
    # States reachable from the start without outputting a word: none of them is final.
    seen, todo = {START}, [START]
    while todo:
        for arc in arcs(fst, todo.pop()):
            if arc.olabel == 0 and arc.nextstate not in seen:
                seen.add(arc.nextstate)
                todo.append(arc.nextstate)
    assert seen == {START, LEADING_SILENCE}
    assert not any(is_final(fst, s) for s in seen)
    # Silence is optional: the start and every word's last state go straight to any word.
    firsts = {input_label(3 * d) for d in range(10)}
    assert firsts <= {a.ilabel for a in arcs(fst, START)}
    assert firsts <= {a.ilabel for a in arcs(fst, 3 + 3 * 4 + 2)}  # digit 4's last state
    assert is_final(fst, SILENCE) and is_final(fst, 3 + 3 * 4 + 2)


@pytest.mark.parametrize("loop", [0.5, 0.9])
def test_graph_arcs_are_probabilities(loop: float):
    # Without a word penalty, each state's arcs sum to probability 1 (H, optional silence
    # and G's uniform 1/10 multiply to 1 over the choices); final weights as documented.
    graph = build_graph(self_loop_prob=loop, silence_prob=0.5)
    fst = graph.fst
    for s in range(fst.num_states):
        total = sum(math.exp(-float(a.weight.value)) for a in arcs(fst, s))
        assert total == pytest.approx(1.0), s
    assert math.exp(-float(fst.final(SILENCE).value)) == pytest.approx(1 - loop)
    assert math.exp(-float(fst.final(3 + 2).value)) == pytest.approx((1 - loop) * 0.5)
    penalised = build_graph(self_loop_prob=loop, word_penalty=2.0).fst
    entering = [a for a in arcs(penalised, START) if a.olabel]
    assert float(entering[0].weight.value) == pytest.approx(-math.log(0.5 / 10) + 2.0)


def test_graph_refuses_bad_probabilities():
    with pytest.raises(ValueError, match="between 0 and 1"):
        build_graph(self_loop_prob=1.0)
    with pytest.raises(ValueError, match="31 classes"):
        build_graph(self_loop_prob=[0.5] * 30)


def test_self_loop_probs_from_durations():
    # Utterance 1: sil x4, class 0 x2, sil x2; utterance 2: sil x2 (a run cut at the boundary).
    labels = np.array([30] * 4 + [0] * 2 + [30] * 2 + [30] * 2)
    probs = estimate_self_loop_probs(labels, np.array([0, 8, 10]), 31)
    assert probs[30] == pytest.approx(1 - 3 / 8)  # 3 runs, 8 frames: mean 8/3
    assert probs[0] == pytest.approx(1 - 1 / 2)
    assert probs[1] == pytest.approx(0.9)  # never seen: the default


# --- the search --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return Decoder(build_graph(), acoustic_scale=1.0)


def test_hand_built_posteriors(decoder: Decoder):
    matrix = frames((SIL, 5), *digit(4), (SIL, 6), *digit(2), (SIL, 5))
    hyp = decoder.decode(matrix)
    assert hyp.words == ("4", "2") and hyp.reached_final


def test_repeated_digit_with_and_without_silence(decoder: Decoder):
    assert decoder.decode(frames((SIL, 3), *digit(7), (SIL, 4), *digit(7), (SIL, 3))).words \
        == ("7", "7")
    assert decoder.decode(frames(*digit(7), *digit(7))).words == ("7", "7")
    assert decoder.decode(frames(*digit(0), *digit(9), *digit(0))).words == ("0", "9", "0")


def test_default_scale_on_realistic_durations():
    # The defaults (scale 0.1, self-loop 0.9) with states of 10 frames, as in the digit set.
    matrix = frames((SIL, 20), *digit(3, 10), (SIL, 15), *digit(8, 10), *digit(1, 10), (SIL, 20))
    assert Decoder(build_graph()).decode(matrix).words == ("3", "8", "1")


def test_search_refuses_a_wrong_width(decoder: Decoder):
    with pytest.raises(ValueError, match="31"):
        decoder.decode(np.zeros((5, 30), dtype=np.float32))
    assert decoder.decode(np.zeros((0, 31), dtype=np.float32)).words == ()


# --- scoring -----------------------------------------------------------------------------------

def test_wer_counts_by_hand():
    refs = {"a": ("1", "2", "3"), "b": ("4", "5"), "c": ("6", "7", "8", "9"),
            "d": ("1", "1", "1", "1"), "e": ("2",)}
    hyps = {"a": ("1", "9", "3"),          # 1 substitution
            "b": ("4", "5", "5"),          # 1 insertion
            "c": ("6", "8", "9"),          # 1 deletion
            "d": ("1", "1", "1", "1")}     # correct; "e" not decoded
    result = score(refs, hyps)
    assert (result.subs, result.ins, result.dels) == (1, 1, 1)
    assert result.ref_words == 13 and result.errors == 3  # "e" is not scored
    assert result.wer == pytest.approx(100 * 3 / 13)
    assert (result.sentence_errors, result.sentences, result.missing) == (3, 4, 1)
    assert result.summary().splitlines() == [
        "%WER 23.08 [ 3 / 13, 1 ins, 1 del, 1 sub ]",
        "%SER 75.00 [ 3 / 4 ]",
        "Scored 4 sentences, 1 not present in hyp."]
    assert [u.errors for u in result.utterances] == [1, 1, 1, 0]


def test_hypothesis_without_reference_is_refused():
    with pytest.raises(ReferencesError, match="no reference.*x"):
        score({"a": ("1",)}, {"a": ("1",), "x": ("2",)})


def test_references_from_utt_ids():
    assert reference_from_utt_id("ho003-en-gb+f3-012-4821") == ("4", "8", "2", "1")
    assert references_from_utt_ids(["tr001-en-us+m1-000-07"]) == {
        "tr001-en-us+m1-000-07": ("0", "7")}
    with pytest.raises(ReferencesError, match="--refs FILE"):
        reference_from_utt_id("utt-abc")


def test_kaldi_text_file(tmp_path):
    path = tmp_path / "text"
    path.write_text("u1 one two\n\nu2\nu3  3 4 5 \n")
    assert read_text(path) == {"u1": ("one", "two"), "u2": (), "u3": ("3", "4", "5")}
    path.write_text("u1 1\nu1 2\n")
    with pytest.raises(ReferencesError, match="twice"):
        read_text(path)
    with pytest.raises(ReferencesError, match="not found"):
        read_text(tmp_path / "missing")


# --- input and the command line ----------------------------------------------------------------

UTTS = {"spk1-000-42": frames((SIL, 5), *digit(4), (SIL, 6), *digit(2), (SIL, 5)),
        "spk1-001-707": frames((SIL, 4), *digit(7), *digit(0), (SIL, 3), *digit(7), (SIL, 4)),
        "spk2-000-19": frames(*digit(1), (SIL, 2), *digit(9))}


def write_ark(tmp_path, utts=UTTS):
    ark, scp = tmp_path / "ll.ark", tmp_path / "ll.scp"
    with kaldiio.WriteHelper(f"ark,scp:{ark},{scp}") as writer:
        for utt, matrix in utts.items():
            writer[utt] = matrix
    return ark, scp


def test_round_trip_through_an_archive(tmp_path, capsys):
    ark, scp = write_ark(tmp_path)
    hyps, report = tmp_path / "hyp.txt", tmp_path / "wer.json"
    assert main([f"ark,scp:{ark},{scp}", "--acoustic-scale", "1", "--hyps", str(hyps),
                 "--json", str(report)]) == 0
    assert hyps.read_text().splitlines() == ["spk1-000-42 4 2", "spk1-001-707 7 0 7",
                                             "spk2-000-19 1 9"]
    assert capsys.readouterr().out.startswith("%WER 0.00 [ 0 / 7, 0 ins, 0 del, 0 sub ]\n")
    data = json.loads(report.read_text())
    assert data["score"]["ref_words"] == 7 and data["utterances"] == 3
    assert data["settings"]["acoustic_scale"] == 1.0
    # The same through ark: and scp: alone, scored against a text file with one error.
    text = tmp_path / "text"
    text.write_text("spk1-000-42 4 2\nspk1-001-707 7 0 7\nspk2-000-19 1 8\n")
    for source in (f"ark:{ark}", f"scp:{scp}", str(scp)):
        assert main([source, "--acoustic-scale", "1", "--refs", str(text)]) == 0
        assert "%WER 14.29 [ 1 / 7, 0 ins, 0 del, 1 sub ]" in capsys.readouterr().out


def test_hdf5_input_in_either_layout(tmp_path, capsys):
    offsets = np.cumsum([0] + [len(m) for m in UTTS.values()])
    for name in ("loglikes", "feats"):
        path = tmp_path / f"{name}.h5"
        with h5py.File(path, "w") as h5:
            h5[name] = np.concatenate(list(UTTS.values()))
            h5["offsets"] = offsets
            h5.create_dataset("utt_ids", data=list(UTTS), dtype=h5py.string_dtype())
        assert len(LoglikesReader(path, 31)) == 3
        assert main([str(path), "--acoustic-scale", "1", "--refs", "utt-id"]) == 0
        assert "%WER 0.00 [ 0 / 7," in capsys.readouterr().out


def test_durations_from_a_label_file(tmp_path, capsys):
    ark, _ = write_ark(tmp_path)
    train = tmp_path / "train.h5"
    with h5py.File(train, "w") as h5:
        h5["labels"] = np.array([30] * 6 + [12] * 4 + [13] * 4 + [14] * 4 + [30] * 6, np.int32)
        h5["offsets"] = np.array([0, 24])
    assert main([str(ark), "--acoustic-scale", "1", "--durations-from", str(train)]) == 0
    assert "%WER 0.00" in capsys.readouterr().out


def test_missing_file_is_a_user_error(tmp_path, capsys):
    missing = tmp_path / "nope.ark"
    assert main([f"ark:{missing}"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "not found" in err and len(err.strip().splitlines()) == 1
    assert main([str(tmp_path / "nope.h5")]) == 2
    assert "nope.h5 not found" in capsys.readouterr().err
    ark, _ = write_ark(tmp_path)
    assert main([str(ark), "--refs", str(tmp_path / "text")]) == 2
    assert "reference file" in capsys.readouterr().err


def test_wrong_number_of_classes_is_a_user_error(tmp_path, capsys):
    ark, _ = write_ark(tmp_path, {"u-12": np.zeros((10, 40), dtype=np.float32)})
    assert main([str(ark)]) == 2
    err = capsys.readouterr().err
    assert "'u-12'" in err and "40 classes" in err and "needs 31" in err
    path = tmp_path / "wide.h5"
    with h5py.File(path, "w") as h5:
        h5["loglikes"] = np.zeros((10, 40), dtype=np.float32)
        h5["offsets"] = np.array([0, 10])
        h5.create_dataset("utt_ids", data=["u-12"], dtype=h5py.string_dtype())
    with pytest.raises(LoglikesError, match=r"shape \[10, 40\]"):
        LoglikesReader(path, 31)
    assert main([str(path)]) == 2


def test_dash_writes_to_stdout_and_the_summary_moves_to_stderr(tmp_path, monkeypatch, capsys):
    """``--hyps -`` (or ``--json -``) is stdout, as Kaldi's tools read it: no file named ``-``."""
    ark, _ = write_ark(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main([f"ark:{ark}", "--acoustic-scale", "1", "--hyps", "-"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["spk1-000-42 4 2", "spk1-001-707 7 0 7", "spk2-000-19 1 9"]
    assert "%WER 0.00" in err and not (tmp_path / "-").exists()
    assert main([f"ark:{ark}", "--acoustic-scale", "1", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["utterances"] == 3 and "%WER 0.00" in err
    assert not (tmp_path / "-").exists()
    assert main([f"ark:{ark}", "--hyps", "-", "--json", "-"]) == 2
    assert "both write to stdout" in capsys.readouterr().err


def test_other_user_errors(tmp_path, capsys):
    ark, _ = write_ark(tmp_path, {"no-digits": frames(*digit(1))})
    assert main([str(ark)]) == 2
    assert "'no-digits'" in capsys.readouterr().err
    assert main([str(ark), "--refs", "none", "--hyps", str(tmp_path / "no" / "h.txt")]) == 2
    assert "--hyps" in capsys.readouterr().err
    nan = frames(*digit(1))
    nan[2, 3] = np.nan
    ark, _ = write_ark(tmp_path, {"u-1": nan})
    assert main([str(ark)]) == 2
    assert "NaN" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([str(ark), "--self-loop-prob", "1.5"])
    assert exc.value.code == 2
