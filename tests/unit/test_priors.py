"""Class priors: counted from the training labels, smoothed, saved, read back, shown."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hadpsgd.assembly.build import make_out_dir
from hadpsgd.config import parse_config
from hadpsgd.data import FeatureFile, write_features
from hadpsgd.data.__main__ import main as data_main
from hadpsgd.data.priors import (
    PRIORS_FILE,
    PriorsError,
    count_labels,
    load_priors,
    priors_of,
    save_priors,
)


def all_labels(path: Path) -> np.ndarray:
    ff = FeatureFile(path)
    return ff.read(0, ff.num_frames)[1]


def test_priors_sum_to_one_and_match_the_label_counts(tiny_data: tuple[Path, Path]) -> None:
    labels = all_labels(tiny_data[0])
    priors = priors_of(tiny_data[0])
    assert np.array_equal(priors.counts, np.bincount(labels, minlength=12))
    assert priors.frames == len(labels) and priors.num_classes == 12
    assert priors.priors.sum() == pytest.approx(1.0, abs=1e-12)
    # Add-one: (count + 1) / (frames + classes), so the order of the counts is kept.
    np.testing.assert_allclose(priors.priors, (priors.counts + 1) / (len(labels) + 12),
                               rtol=1e-15)


def test_a_class_without_frames_gets_the_smallest_prior_not_zero(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    labels = np.array([0, 0, 0, 2, 2, 3] * 5)  # class 1 never occurs
    write_features(tmp_path / "f.h5", [rng.standard_normal((30, 3))], [labels], ["u"],
                   num_classes=4)
    priors = priors_of(tmp_path / "f.h5")
    assert priors.counts[1] == 0 and priors.priors[1] == pytest.approx(1 / 34)
    assert priors.priors.argmin() == 1 and (priors.priors > 0).all()
    assert np.array_equal(count_labels(tmp_path / "f.h5"), [15, 0, 10, 5])


def test_saved_json_reads_back(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    priors = priors_of(tiny_data[0])
    path = save_priors(priors, tmp_path / PRIORS_FILE)
    saved = json.loads(path.read_text())
    assert saved["source"] == str(tiny_data[0].resolve()) and saved["smoothing"].startswith("add")
    assert saved["counts"] == priors.counts.astype(int).tolist()
    assert saved["priors"] == priors.priors.tolist()
    back = load_priors(path)
    assert np.array_equal(back.counts, priors.counts) and back.source == priors.source


def test_a_kaldi_text_vector_of_counts_reads(tmp_path: Path) -> None:
    (tmp_path / "counts").write_text(" [ 120 0 30 ]\n")
    priors = load_priors(tmp_path / "counts")
    np.testing.assert_allclose(priors.priors, np.array([121, 1, 31]) / 153)


def test_a_feature_file_is_counted(tiny_data: tuple[Path, Path]) -> None:
    assert np.array_equal(load_priors(tiny_data[0]).counts, priors_of(tiny_data[0]).counts)


@pytest.mark.parametrize("text,named", [("{\"priors\": [1]}", "'counts'"),
                                        ("[ 1 x 2 ]", "neither a priors JSON"),
                                        ("[ 1 -2 ]", "finite and >= 0"), ("[ ]", "non-empty")])
def test_a_bad_priors_file_is_named(tmp_path: Path, text: str, named: str) -> None:
    (tmp_path / "p").write_text(text)
    with pytest.raises(PriorsError, match=named) as err:
        load_priors(tmp_path / "p")
    assert str(tmp_path / "p") in str(err.value)
    with pytest.raises(PriorsError, match="cannot be read"):
        load_priors(tmp_path / "missing.json")


def test_data_info_shows_the_priors(tiny_data: tuple[Path, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert data_main(["info", str(tiny_data[0])]) == 0
    text = capsys.readouterr().out
    assert "priors (add-one smoothed), most probable: " in text
    assert data_main(["info", "--json", str(tiny_data[0])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["priors"]["vector"] == priors_of(tiny_data[0]).priors.tolist()
    assert info["priors"]["most_probable"][0][0] == int(np.argmax(info["priors"]["vector"]))


def _topo() -> SimpleNamespace:
    """What make_out_dir reads of a one-learner topology."""
    return SimpleNamespace(rank=0, size=1, num_nodes=1, node_sizes=[1], device=torch.device("cpu"),
                           hosts=["here"], placement="here:cpu", intra_backend="mpi",
                           bcast_object=lambda obj, root=0: obj)


def test_a_fresh_run_directory_gets_the_training_priors(tiny_data: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    cfg = parse_config(["--train", str(tiny_data[0]), "--heldout", str(tiny_data[1]),
                        "--out-dir", str(tmp_path / "run"), "--preset", "tiny"])
    out = make_out_dir(cfg, _topo(), tiny_data[0])  # type: ignore[arg-type]
    priors = load_priors(out / PRIORS_FILE)
    assert np.array_equal(priors.counts, np.bincount(all_labels(tiny_data[0]), minlength=12))
    assert (out / "config.json").is_file()
