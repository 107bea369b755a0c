"""The forward pass for decoding: equal to the model's own evaluation, priors, outputs, refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from hadpsgd.data import (
    PRIORS_FILE,
    ChunkDataset,
    FeatureFile,
    Priors,
    load_priors,
    priors_of,
    save_priors,
)
from hadpsgd.data.loader import IGNORE
from hadpsgd.forward import ForwardError, forward_utterance, load_model, window_plan
from hadpsgd.forward.__main__ import parser, setup
from hadpsgd.forward.job import run, split_by_frames
from hadpsgd.forward.output import merge, open_writer, parse_output, part_spec
from hadpsgd.models import build_model
from hadpsgd.train import evaluate
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint
from tests.fakes import OneLearner

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def make_run(out: Path, train: Path, input_dim: int, num_classes: int, seed: int = 0) -> Path:
    """A run directory with one checkpoint of a tiny BLSTM (random weights) and its priors."""
    torch.manual_seed(seed)
    model = build_model("tiny", input_dim, num_classes)
    config = {"data": {"train": str(train), "chunk_len": 21},
              "model": {"preset": "tiny", "lstm_layout": "auto"}, "train": {"precision": "fp32"}}
    state = {"model": model.state_dict(), "config": config,
             "progress": {"epoch": 0, "step_in_epoch": 0, "global_step": 5}}
    save_checkpoint(state, checkpoint_path(out / "checkpoints", 5), meta={"step": 5})
    if num_classes == FeatureFile(train).num_classes:
        save_priors(priors_of(train), out / PRIORS_FILE)
    return out


@pytest.fixture(scope="module")
def run_dir(tiny_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"), tiny_data[0], 260, 12)


def forward(*argv: str | Path) -> None:
    """``python -m hadpsgd.forward ARGV`` in this process, on one CPU learner."""
    topo = OneLearner()
    run(topo, setup(parser().parse_args([str(a) for a in argv] + ["--no-progress"]), topo))


def read_h5(path: Path) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
    with h5py.File(path, "r") as h5:
        return (h5["loglikes"][()], h5["offsets"][()], list(h5["utt_ids"].asstr()[()]),
                dict(h5.attrs))


def test_whole_equals_the_models_log_softmax(run_dir: Path, tiny_data: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    out = tmp_path / "out.h5"
    forward(run_dir, "--features", tiny_data[1], "--out", out, "--priors", "none")
    scores, offsets, ids, attrs = read_h5(out)
    ff, model = FeatureFile(tiny_data[1]), load_model(run_dir).model
    assert ids == ff.utt_ids and np.array_equal(offsets, ff.offsets)
    assert attrs["kind"] == "log-posteriors" and attrs["num_classes"] == 12
    with torch.no_grad():
        for u in range(ff.num_utts):
            x = torch.from_numpy(ff.read(int(offsets[u]), int(offsets[u + 1]))[0])
            ref = F.log_softmax(model(x[None]), dim=-1)[0]
            # One utterance alone is exactly model(utterance); the packed batches of the
            # command equal it within float32 rounding.
            assert torch.equal(forward_utterance(model, x), ref)
            torch.testing.assert_close(torch.from_numpy(scores[offsets[u]:offsets[u + 1]]), ref)


def test_chunks_without_overlap_equal_the_evaluations_chunks(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "out.h5"
    forward("--model", run_dir, "--features", tiny_data[1], "--output", out, "--priors", "none",
            "--context", "chunks", "--chunk-overlap", "0")  # chunk_len: the training's 21
    scores = read_h5(out)[0]
    model, dataset = load_model(run_dir).model, ChunkDataset(tiny_data[1], 21)
    covered = []
    with torch.no_grad():
        for i in range(len(dataset)):
            feats, labels = dataset[i]
            counted = labels != IGNORE
            frames = int(dataset.starts[i]) + torch.arange(21)[counted]
            ref = F.log_softmax(model(feats[None]), dim=-1)[0][counted]
            torch.testing.assert_close(torch.from_numpy(scores[frames.numpy()]), ref)
            covered.append(frames)
    assert torch.equal(torch.cat(covered).sort().values, torch.arange(len(scores)))
    labels = FeatureFile(tiny_data[1]).read(0, len(scores))[1]
    held_out = evaluate(model, dataset, OneLearner())  # type: ignore[arg-type]
    assert float((scores.argmax(1) == labels).mean()) == pytest.approx(held_out.accuracy,
                                                                       abs=1e-12)


def test_pseudo_log_likelihoods_are_log_posteriors_minus_log_priors(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "post.h5",
            "--priors", "none")
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "pll.h5")
    post, pll = read_h5(tmp_path / "post.h5"), read_h5(tmp_path / "pll.h5")
    assert pll[3]["kind"] == "pseudo-log-likelihoods"  # --priors auto found RUN/priors.json
    priors = load_priors(run_dir / PRIORS_FILE).priors
    np.testing.assert_allclose(pll[0] - post[0], np.broadcast_to(-np.log(priors), post[0].shape),
                               rtol=0, atol=1e-5)


def test_a_prior_scale_takes_that_power_of_the_priors(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    # The hybrid's scaled likelihood p(s|x) / p(s)^P, from the log-posteriors and the priors'
    # own counts (add-one smoothed), not from the code's log_priors.
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "post.h5",
            "--priors", "none")
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "p03.h5",
            "--prior-scale", "0.3")
    post, scaled = read_h5(tmp_path / "post.h5"), read_h5(tmp_path / "p03.h5")
    counts = load_priors(run_dir / PRIORS_FILE).counts
    priors = (counts + 1) / (counts.sum() + len(counts))
    np.testing.assert_allclose(scaled[0] - post[0],
                               np.broadcast_to(-0.3 * np.log(priors), post[0].shape),
                               rtol=0, atol=1e-5)
    assert scaled[3]["kind"] == "pseudo-log-likelihoods" and scaled[3]["prior_scale"] == 0.3


@pytest.mark.parametrize("flags,named", [
    (["--prior-scale", "-0.5"], "--prior-scale -0.5: the priors' exponent must be"),
    (["--prior-scale", "nan"], "--prior-scale nan: the priors' exponent must be"),
    (["--prior-scale", "0.5", "--priors", "none"], "--prior-scale 0.5 without priors"),
])
def test_a_prior_scale_that_cannot_apply_is_refused(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path, flags: list[str],
        named: str) -> None:
    with pytest.raises(ForwardError, match=named):
        forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "o.h5",
                *flags)
    assert not (tmp_path / "o.h5").exists()


def test_ark_read_back_with_kaldiio_equals_the_h5(run_dir: Path, tiny_data: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    kaldiio = pytest.importorskip("kaldiio")
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "o.h5")
    forward("--model", run_dir, "--features", tiny_data[1], "--output",
            f"ark,scp:{tmp_path / 'o.ark'},{tmp_path / 'o.scp'}")
    scores, offsets, ids, _ = read_h5(tmp_path / "o.h5")
    table = kaldiio.load_scp(str(tmp_path / "o.scp"))
    assert list(table) == ids
    for u, utt in enumerate(ids):
        assert np.array_equal(table[utt], scores[offsets[u]:offsets[u + 1]])
    streamed = dict(kaldiio.ReadHelper(f"ark:{tmp_path / 'o.ark'}"))
    assert all(np.array_equal(streamed[utt], table[utt]) for utt in ids)


def test_kaldi_features_take_the_trainings_normalisation(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    kaldiio = pytest.importorskip("kaldiio")
    ff = FeatureFile(tiny_data[1])
    raw = ff.feats_dataset[()]  # as stored: not normalised
    with kaldiio.WriteHelper(f"ark:{tmp_path / 'raw.ark'}") as writer:
        for u, utt in enumerate(ff.utt_ids):
            writer(utt, raw[ff.offsets[u]:ff.offsets[u + 1]])
    forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "h5.h5")
    forward("--model", run_dir, "--features", f"ark:{tmp_path / 'raw.ark'}", "--output",
            tmp_path / "kaldi.h5")  # --norm auto: the training file's statistics
    a, b = read_h5(tmp_path / "h5.h5"), read_h5(tmp_path / "kaldi.h5")
    assert a[2] == b[2]
    np.testing.assert_allclose(a[0], b[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dims,named", [((7, 12), ("7-dim", "260-dim")),
                                        ((260, 5), ("5 output classes", "12 classes"))])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_both(
        tiny_data: tuple[Path, Path], tmp_path: Path, dims: tuple[int, int],
        named: tuple[str, str]) -> None:
    bad = make_run(tmp_path / "bad", tiny_data[0], *dims)
    with pytest.raises(ForwardError) as err:
        forward("--model", bad, "--features", tiny_data[1], "--output", tmp_path / "o.h5")
    assert all(n in str(err.value) for n in named), err.value
    assert not (tmp_path / "o.h5").exists()


def test_priors_of_another_class_count_are_refused(run_dir: Path, tiny_data: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    (tmp_path / "counts.txt").write_text("[ 3 4 5 ]\n")
    with pytest.raises(ForwardError, match="12 output classes.*have 3"):
        forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "o.h5",
                "--priors", tmp_path / "counts.txt")
    # Another run's priors.json records its training file as the source: the message names
    # the file passed, and the training file beside it.
    other = save_priors(Priors(np.array([3.0, 4.0, 5.0]), "/data/other-train.h5"),
                        tmp_path / "other-priors.json")
    with pytest.raises(ForwardError, match=f"the priors {other} \\(counted from "
                                           "/data/other-train.h5\\) have 3"):
        forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "o.h5",
                "--priors", other)


@pytest.mark.parametrize("flags,named", [
    (["--model", "/nonexistent/run"], "the model /nonexistent/run does not exist"),
    (["--output", "out.txt"], "--out out.txt is neither"),
    (["--output", "/nonexistent/dir/o.h5"], "directory /nonexistent/dir does not exist"),
    (["--context", "chunks", "--chunk-overlap", "11"], "--chunk-overlap 11"),
    (["--norm", "none"], "--norm none applies to Kaldi features only"),
])
def test_user_errors_name_the_flag(run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path,
                                   flags: list[str], named: str) -> None:
    base = {"--model": str(run_dir), "--features": str(tiny_data[1]),
            "--output": str(tmp_path / "o.h5")}
    argv = [a for k, v in base.items() if k not in flags for a in (k, v)] + flags
    with pytest.raises(ForwardError, match=named.replace("-", r"\-")):
        forward(*argv)


def test_one_spelling_with_export_and_the_older_one_still_read(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    """``forward RUN --out F``, as ``export RUN --out F``; ``--model`` and ``--output`` too."""
    feats, out = str(tiny_data[1]), str(tmp_path / "o.h5")
    new = parser().parse_args([str(run_dir), "--features", feats, "--out", out])
    old = parser().parse_args(["--model", str(run_dir), "--features", feats, "--output", out])
    assert vars(new) == vars(old) and new.model == str(run_dir) and new.out == out
    text = parser().format_help()
    assert "--out WSPECIFIER|FILE.h5" in text and "--output WSPECIFIER" not in text
    assert "also read as --model" in text and "also read as --output" in text
    for argv, named in ((["--features", feats, "--out", out], "name the model to run"),
                        ([str(run_dir), "--features", feats], "--out WSPECIFIER|FILE.h5")):
        with pytest.raises(SystemExit) as exc:
            parser().parse_args(argv)
        assert exc.value.code == 2 and named in capsys.readouterr().err


def test_the_command_reports_a_user_error_in_one_line(tiny_data: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    bad = make_run(tmp_path / "bad", tiny_data[0], 7, 12)
    res = subprocess.run([sys.executable, "-m", "hadpsgd.forward", "--model", str(bad),
                          "--features", str(tiny_data[1]), "--output", str(tmp_path / "o.h5")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert res.stderr.startswith("hadpsgd.forward: error: feature dimension mismatch")


@pytest.mark.parametrize("length,chunk_len,overlap", [(21, 21, 0), (22, 21, 0), (100, 21, 0),
                                                      (100, 21, 5), (100, 21, 10), (50, 41, 10),
                                                      (64, 8, 3)])
def test_windows_keep_every_frame_once_inside_the_utterance(length: int, chunk_len: int,
                                                            overlap: int) -> None:
    win, lo, hi = window_plan(length, chunk_len, overlap)
    assert np.array_equal(np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)]),
                          np.arange(length))
    assert (win >= 0).all() and (win + chunk_len <= length).all()
    assert (win <= lo).all() and (hi <= win + chunk_len).all()


def test_split_by_frames_is_contiguous_complete_and_balanced() -> None:
    lengths = list(np.random.default_rng(0).integers(1, 500, size=97))
    for size in (1, 2, 3, 8):
        ranges = split_by_frames(lengths, size)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        shares = [sum(lengths[a:b]) for a, b in ranges]
        assert max(shares) - min(shares) <= 2 * max(lengths)


@pytest.mark.parametrize("spec", ["o.h5", "ark:o.ark", "ark,scp:o.ark,o.scp"])
def test_parts_merge_into_one_output_in_rank_order(tmp_path: Path, spec: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    kaldiio = pytest.importorskip("kaldiio")
    monkeypatch.chdir(tmp_path)
    out = parse_output(spec)
    rng = np.random.default_rng(1)
    mats = {f"u{i}": rng.standard_normal((i + 2, 4)).astype(np.float32) for i in range(5)}
    for rank, keys in enumerate((["u0", "u1"], [], ["u2", "u3", "u4"])):
        writer = open_writer(part_spec(out, rank), 4, {"kind": "log-posteriors"})
        for key in keys:
            writer.write(key, mats[key])
        writer.close()
    merge(out, 3)
    if out.h5 is not None:
        scores, offsets, ids, _ = read_h5(tmp_path / "o.h5")
        got = {u: scores[offsets[i]:offsets[i + 1]] for i, u in enumerate(ids)}
        assert not list(tmp_path.glob("o.*.h5"))
    else:
        source = "scp:o.scp" if out.scp else "ark:o.ark"
        got = dict(kaldiio.ReadHelper(source))
    assert list(got) == list(mats)
    assert all(np.array_equal(got[k], mats[k]) for k in mats)


def test_the_forward_decides_tf32(run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 means IEEE fp32 unless --tf32, as in training: the choice is set, not left to
    torch's default (cuDNN's TF32 is on there)."""
    import hadpsgd.forward.__main__ as command

    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(command, "set_tf32", lambda device, allow: calls.append((device.type,
                                                                                  allow)))
    for flags in ([], ["--tf32"]):
        forward("--model", run_dir, "--features", tiny_data[1], "--output", tmp_path / "o.h5",
                "--priors", "none", "--overwrite", *flags)  # the second replaces the first
    assert calls == [("cpu", False), ("cpu", True)]


def test_a_groups_scores_are_written_in_order_after_one_wait() -> None:
    from tqdm import tqdm

    from hadpsgd.forward.job import _Scores

    group = [("a", np.zeros((3, 2))), ("empty", np.zeros((0, 2))), ("b", np.zeros((2, 2)))]
    outputs = [torch.arange(6.0).view(3, 2), torch.zeros(0, 2), torch.ones(2, 2)]
    written: list[tuple[str, np.ndarray]] = []

    class Writer:
        def write(self, utt: str, mat: np.ndarray) -> None:
            written.append((utt, mat.copy()))

    scores = _Scores(group, outputs, torch.tensor([1.0, 2.0]))
    assert scores.frames == 5
    assert scores.write(Writer(), tqdm(disable=True)) == 3  # type: ignore[arg-type]
    assert [u for u, _ in written] == ["a", "empty", "b"]
    for (_, mat), out in zip(written, outputs, strict=True):
        np.testing.assert_array_equal(mat, (out - torch.tensor([1.0, 2.0])).numpy())


# --- outputs: complete under their final names or not there at all (issue 34) ---------------

def listing(where: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in where.iterdir())


@pytest.mark.parametrize("spec", ["o.h5", "ark,scp:o.ark,o.scp", "ark:o.ark"])
def test_a_crash_in_the_middle_leaves_no_file_under_the_final_names(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    pytest.importorskip("kaldiio")
    import hadpsgd.forward.chunks as chunks
    from hadpsgd.forward.features import H5Features

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(chunks, "MAX_BATCH", 2)  # groups of two: two are written by utterance 7
    read, seen = H5Features.read, []

    def crashing(self: H5Features, first: int = 0, stop: int | None = None):  # noqa: ANN202
        for n, item in enumerate(read(self, first, stop)):
            if n == 7:
                seen.append(listing(tmp_path))  # what a kill at this moment would leave
                raise OSError("the disk went away")
            yield item

    monkeypatch.setattr(H5Features, "read", crashing)
    with pytest.raises(OSError, match="went away"):
        forward("--model", run_dir, "--features", tiny_data[1], "--output", spec)
    assert seen and seen[0], "nothing was being written"
    # Only hidden temporaries, matrices already in them (an scp's lines may still be buffered).
    assert all(name.startswith(".o.") and ".tmp-" in name for name, _ in seen[0]), seen
    assert max(size for _, size in seen[0]) > 0, seen
    assert listing(tmp_path) == []  # and the aborted job removed them


@pytest.mark.parametrize("spec,there,named", [
    ("o.h5", ["o.h5"], "o.h5 already exists"),
    ("ark,scp:o.ark,o.scp", ["o.scp"], "o.scp already exists"),
    ("ark,scp:o.ark,o.scp", ["o.ark", "o.scp"], "o.ark, o.scp already exist"),
])
def test_an_existing_output_is_refused_by_name(run_dir: Path, tiny_data: tuple[Path, Path],
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               spec: str, there: list[str], named: str) -> None:
    monkeypatch.chdir(tmp_path)
    for name in there:
        (tmp_path / name).write_text("someone's results\n")
    with pytest.raises(ForwardError, match=f"--out: {named}; pass --overwrite"):
        forward("--model", run_dir, "--features", tiny_data[1], "--output", spec)
    assert all((tmp_path / n).read_text() == "someone's results\n" for n in there)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(there)


def test_overwrite_replaces_and_the_scp_names_the_final_archive(
        run_dir: Path, tiny_data: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    kaldiio = pytest.importorskip("kaldiio")
    monkeypatch.chdir(tmp_path)
    forward("--model", run_dir, "--features", tiny_data[1], "--output", "fresh.h5")
    for name in ("o.h5", "o.ark", "o.scp"):
        (tmp_path / name).write_text("old u0 o.ark:7\n")
    forward("--model", run_dir, "--features", tiny_data[1], "--output", "o.h5", "--overwrite")
    forward("--model", run_dir, "--features", tiny_data[1], "--output", "ark,scp:o.ark,o.scp",
            "--overwrite")
    scores, offsets, ids, _ = read_h5(tmp_path / "fresh.h5")
    assert np.array_equal(read_h5(tmp_path / "o.h5")[0], scores)
    lines = (tmp_path / "o.scp").read_text().splitlines()
    assert [ln.split()[1].rpartition(":")[0] for ln in lines] == ["o.ark"] * len(ids)
    table = kaldiio.load_scp("o.scp")
    assert list(table) == ids
    assert all(np.array_equal(table[u], scores[offsets[i]:offsets[i + 1]])
               for i, u in enumerate(ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # each archive file's sidecar too
        "fresh.h5", "o.ark", "o.ark.json", "o.h5", "o.scp", "o.scp.json"]


def test_under_mpirun_every_part_counts_and_an_old_index_goes_first(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hadpsgd.forward.job import check_new, retire_index, targets

    out = parse_output(f"ark,scp:{tmp_path / 'o.ark'},{tmp_path / 'o.scp'}")
    assert [p.name for p in targets(out, 2)] == ["o.scp", "o.0.ark", "o.0.scp", "o.1.ark",
                                                 "o.1.scp"]  # o.ark itself is never written
    assert [p.name for p in targets(parse_output(str(tmp_path / "o.h5")), 2)] == [
        "o.h5", "o.0.h5", "o.1.h5"]
    (tmp_path / "o.1.ark").write_bytes(b"a part left by a job that died before its merge")
    with pytest.raises(ForwardError, match=r"o\.1\.ark already exists; pass --overwrite"):
        check_new(out, 2, overwrite=False)
    check_new(out, 2, overwrite=True)
    (tmp_path / "o.scp").write_text("u0 o.0.ark:3\n")  # the old index into the old archives
    rank0 = SimpleNamespace(rank=0, size=2, allgather_object=lambda mine: [mine, None])
    retire_index(rank0, out)  # type: ignore[arg-type]
    assert not (tmp_path / "o.scp").exists()
    (tmp_path / "o").mkdir()
    with pytest.raises(ForwardError, match="is a directory"):
        check_new(parse_output(f"ark:{tmp_path / 'o'}"), 1, overwrite=True)


def test_an_scp_into_a_stream_is_refused() -> None:
    pytest.importorskip("kaldiio")
    with pytest.raises(ForwardError, match="an scp holds byte offsets into a file"):
        parse_output("ark,scp:-,o.scp")
