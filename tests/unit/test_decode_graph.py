"""Decoding through a user's graph (``--graph``/``--words``) and defaults by the kind of scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import kaldifst
import kaldiio
import numpy as np
import pytest

from hadpsgd.decode.__main__ import main
from tests.unit.test_decode import UTTS, write_ark

YES, NO, SIL = 0, 1, 2  # the hand-built model's three classes
ON, OFF = math.log(0.9), math.log(0.05)


def posteriors(*segments: tuple[int, int]) -> np.ndarray:
    """Log-posteriors [T, 3]: ``(class, n)`` is n frames of that class."""
    classes = np.concatenate([np.full(n, c) for c, n in segments])
    out = np.full((len(classes), 3), OFF, dtype=np.float32)
    out[np.arange(len(classes)), classes] = ON
    return out


def yes_no_graph(path: Path, const: bool = False, extra_label: int = 0) -> Path:
    """A word loop of "yes" and "no" with optional silence, input labels class + 1.

    State 0 loops on silence and is final; a word is entered on its class's label, loops on
    it, and returns to state 0 through an epsilon arc (consuming no frame).
    """
    fst = kaldifst.StdVectorFst()
    for _ in range(3):
        fst.add_state()
    fst.start = 0
    fst.add_arc(0, kaldifst.StdArc(SIL + 1, 0, 0.5, 0))
    for state, (cls, word) in ((1, (YES, 1)), (2, (NO, 2))):
        fst.add_arc(0, kaldifst.StdArc(cls + 1, word, 1.0, state))
        fst.add_arc(state, kaldifst.StdArc(cls + 1, 0, 0.1, state))
        fst.add_arc(state, kaldifst.StdArc(0, 0, 0.5, 0))
    if extra_label:
        fst.add_arc(0, kaldifst.StdArc(extra_label, 0, 1.0, 0))
    fst.set_final(0, 0.0)
    (kaldifst.StdConstFst(fst) if const else fst).write(str(path))
    return path


@pytest.fixture
def yes_no(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """An archive of two utterances, their references, the words and the graph."""
    ark = tmp_path / "ll.ark"
    kaldiio.save_ark(str(ark), {
        "u1": posteriors((SIL, 3), (YES, 5), (SIL, 2), (NO, 4), (SIL, 2)),
        "u2": posteriors((NO, 6), (NO, 0), (SIL, 3), (NO, 5), (YES, 4))})
    text = tmp_path / "text"
    text.write_text("u1 yes no\nu2 no no yes\n")
    words = tmp_path / "words.txt"
    words.write_text("<eps> 0\nyes 1\nno 2\n")
    return ark, text, words, yes_no_graph(tmp_path / "G.fst")


@pytest.mark.parametrize("const", [False, True])
def test_a_users_graph_decodes_to_its_words(yes_no: tuple[Path, Path, Path, Path],
                                            tmp_path: Path, const: bool,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ark, text, words, _ = yes_no
    graph = yes_no_graph(tmp_path / "HCLG.fst", const=const)
    hyps = tmp_path / "hyp.txt"
    assert main([f"ark:{ark}", "--graph", str(graph), "--words", str(words), "--refs", str(text),
                 "--acoustic-scale", "1", "--hyps", str(hyps)]) == 0
    assert hyps.read_text().splitlines() == ["u1 yes no", "u2 no no yes"]
    assert capsys.readouterr().out.startswith("%WER 0.00 [ 0 / 5, 0 ins, 0 del, 0 sub ]")


def test_a_graph_that_does_not_fit_is_refused_by_name(yes_no: tuple[Path, Path, Path, Path],
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ark, _, words, graph = yes_no
    wide = yes_no_graph(tmp_path / "wide.fst", extra_label=5)  # class 4 of a 3-class model
    assert main([str(ark), "--graph", str(wide), "--words", str(words)]) == 2
    err = capsys.readouterr().err
    assert "input label 5 names class 4" in err and "the model has 3 classes" in err
    (tmp_path / "short.txt").write_text("<eps> 0\nyes 1\n")
    assert main([str(ark), "--graph", str(graph), "--words", str(tmp_path / "short.txt")]) == 2
    assert "output label(s) 2 are not in --words" in capsys.readouterr().err
    assert main([str(ark), "--graph", str(graph), "--words", str(words),
                 "--word-penalty", "2"]) == 2
    assert "--word-penalty shape the digit-loop graph" in capsys.readouterr().err
    assert main([str(ark), "--graph", str(graph)]) == 2
    assert "needs --words" in capsys.readouterr().err
    (tmp_path / "junk.fst").write_text("not an fst")
    assert main([str(ark), "--graph", str(tmp_path / "junk.fst"), "--words", str(words)]) == 2
    assert "not an FST" in capsys.readouterr().err


def write_h5(path: Path, **attrs: object) -> Path:
    """The utterances of ``UTTS`` as ``hadpsgd.forward`` lays them out, with these attributes."""
    with h5py.File(path, "w") as h5:
        h5["loglikes"] = np.concatenate(list(UTTS.values()))
        h5["offsets"] = np.cumsum([0] + [len(m) for m in UTTS.values()])
        h5.create_dataset("utt_ids", data=list(UTTS), dtype=h5py.string_dtype())
        h5.attrs.update(attrs)
    return path


def test_the_word_penalty_follows_the_kind_of_scores(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def settings(source: str) -> tuple[float, str | None]:
        report = tmp_path / "r.json"
        assert main([source, "--json", str(report), "--overwrite"]) == 0
        data = json.loads(report.read_text())
        return data["settings"]["word_penalty"], data["kind"]

    path = write_h5(tmp_path / "ll.h5", kind="pseudo-log-likelihoods")
    assert settings(str(path)) == (4.0, "pseudo-log-likelihoods")
    assert "word penalty 4 (the default for this kind)" in capsys.readouterr().err
    ark, scp = write_ark(tmp_path)
    assert settings(f"scp:{scp}") == (0.0, None)  # no sidecar: the kind is unknown
    assert "pass --word-penalty 4 if these are pseudo" in capsys.readouterr().err
    (tmp_path / "ll.scp.json").write_text(json.dumps(
        {"kind": "log-posteriors", "bytes": scp.stat().st_size}))
    assert settings(f"ark,scp:{ark},{scp}") == (0.0, "log-posteriors")


def test_the_priors_exponent_is_said_and_recorded(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A file written with ``hadpsgd.forward --prior-scale`` says so in the decode's report."""
    def decode(source: str) -> tuple[float | None, str]:
        report = tmp_path / "r.json"
        assert main([source, "--json", str(report), "--overwrite"]) == 0
        return json.loads(report.read_text())["prior_scale"], capsys.readouterr().err

    path = write_h5(tmp_path / "ll.h5", kind="pseudo-log-likelihoods", prior_scale=0.75)
    scale, err = decode(str(path))
    assert scale == 0.75
    assert "pseudo-log-likelihoods at the priors' exponent 0.75" in err
    with h5py.File(path, "a") as h5:
        del h5.attrs["prior_scale"]  # written before the flag: nothing to say
    scale, err = decode(str(path))
    assert scale is None and "exponent" not in err
    ark, scp = write_ark(tmp_path)
    (tmp_path / "ll.scp.json").write_text(json.dumps(
        {"kind": "pseudo-log-likelihoods", "bytes": scp.stat().st_size, "prior_scale": 1.0}))
    scale, err = decode(f"ark,scp:{ark},{scp}")
    assert scale == 1.0 and "at the priors' exponent 1 (ll.scp.json)" in err
    (tmp_path / "ll.scp.json").write_text(json.dumps(
        {"kind": "log-posteriors", "bytes": scp.stat().st_size, "prior_scale": 0.0}))
    assert decode(f"ark,scp:{ark},{scp}")[0] is None  # posteriors subtract no priors
