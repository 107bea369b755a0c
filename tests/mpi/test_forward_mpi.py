"""``python -m hadpsgd.forward`` under mpirun: the priors a training leaves, and two ranks'
output equal to one process's."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hadpsgd.data import PRIORS_FILE, FeatureFile, load_priors
from tests._commands import run_command
from tests._mpi import assert_ok
from tests.mpi._resume import run_args

pytestmark = pytest.mark.mpi

# Windows: each utterance is computed alone, so how utterances fall to ranks changes no bit.
CONTEXT = ("--context", "chunks", "--chunk-len", "21", "--chunk-overlap", "3")


@pytest.fixture(scope="module")
def trained(tiny_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("forward") / "run"
    assert_ok(run_command(2, run_args(tiny_data, out, "--max-steps", "5")))
    return out


def forward(nprocs: int, model: Path, features: str, output: str, *extra: str) -> None:
    assert_ok(run_command(nprocs, ["-m", "hadpsgd.forward", "--model", str(model), "--features",
                               features, "--output", output, "--no-progress", *extra]))


def read_h5(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    with h5py.File(path, "r") as h5:
        return h5["loglikes"][()], h5["offsets"][()], list(h5["utt_ids"].asstr()[()])


def test_a_training_leaves_the_priors_of_its_labels(trained: Path,
                                                    tiny_data: tuple[Path, Path]) -> None:
    ff = FeatureFile(tiny_data[0])
    priors = load_priors(trained / PRIORS_FILE)
    assert np.array_equal(priors.counts, np.bincount(ff.read(0, ff.num_frames)[1], minlength=12))
    assert priors.priors.sum() == pytest.approx(1.0, abs=1e-12)


def test_two_ranks_write_the_same_matrices_as_one(trained: Path, tiny_data: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    kaldiio = pytest.importorskip("kaldiio")
    heldout = str(tiny_data[1])
    forward(1, trained, heldout, str(tmp_path / "one.h5"), *CONTEXT)
    forward(2, trained, heldout, str(tmp_path / "two.h5"), *CONTEXT)
    one, two = read_h5(tmp_path / "one.h5"), read_h5(tmp_path / "two.h5")
    assert one[2] == two[2] == FeatureFile(heldout).utt_ids
    assert np.array_equal(one[1], two[1]) and np.array_equal(one[0], two[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.h5", "two.h5"]  # parts merged

    # A Kaldi table in, an archive per rank and one scp out: rank 0 learns the lengths.
    ff = FeatureFile(heldout)
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path / 'feats.ark'},{tmp_path / 'feats.scp'}") as w:
        for u, utt in enumerate(ff.utt_ids):  # normalised as the .h5 gives them
            w(utt, ff.read(int(ff.offsets[u]), int(ff.offsets[u + 1]))[0])
    forward(2, trained, f"scp:{tmp_path / 'feats.scp'}",
            f"ark,scp:{tmp_path / 'o.ark'},{tmp_path / 'o.scp'}", "--norm", "none", *CONTEXT)
    table = kaldiio.load_scp(str(tmp_path / "o.scp"))
    assert list(table) == one[2]
    for u, utt in enumerate(one[2]):
        assert np.array_equal(table[utt], one[0][one[1][u]:one[1][u + 1]])
    assert (tmp_path / "o.0.ark").is_file() and (tmp_path / "o.1.ark").is_file()
