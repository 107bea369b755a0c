"""BMUF's overlapped, streaming, compressed syncs through the main command's trainer on
learners as threads (``tests/trainer_threads.py``): a run stopped by a fault at step 13 and
resumed from its step-10 checkpoint (a mean in flight, the wire's residuals per worker) ends
bit for bit as the uninterrupted one. ``tests/mpi/test_bmuf_cli.py`` runs the same check
under mpirun for int8 with a real ``kill -9``; here int4, sign and top-k, whose codes run
unchanged on the thread world's side channel (:mod:`hadpsgd.comm.thread_links`), and sign
with its rounding kept in the worker's model (``--bmuf-residual model``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hadpsgd.faults import InjectedFault
from hadpsgd.models import build_model
from tests.mpi._resume import assert_same_run
from tests.trainer_threads import train_on_threads


def _train(data: tuple[Path, Path], out: Path, *extra: str,
           fault: str | None = None) -> list[dict]:
    """The flags of ``test_bmuf_cli._train``: 2 super-learners of one learner, BMUF-Adam."""
    flags = ["--train", str(data[0]), "--heldout", str(data[1]), "--preset", "tiny",
             "--out-dir", str(out), "--no-progress", "--algo", "bmuf", "--optimizer", "adam",
             "--beta1", "0.5", "--lr", "0.002", "--warmup-epochs", "0", "--batch-size", "8",
             "--epochs", "3", "--sync-period", "3", "--bmuf-warmup-steps", "2",
             "--ranks-per-node", "1", *extra]
    return train_on_threads(flags, 2, fault=fault,
                            env={"HADPSGD_TRACE_CHUNKS": str(out / "trace")})


@pytest.mark.parametrize("wire", [("int4",), ("sign",), ("topk", "--topk-fraction", "0.03"),
                                  ("sign", "--bmuf-residual", "model"), ("signtopk",)],
                         ids=["int4", "sign", "topk", "sign-residual-in-model", "signtopk"])
def test_overlapped_streaming_compressed_resume_is_bit_exact(tiny_data, tmp_path, wire):
    k = 10
    extra = ("--max-steps", str(2 * k), "--checkpoint-every", str(k), "--bmuf-overlap",
             "--bmuf-fragments", "2", "--wire", *wire, "--adam-moments", "corrected")
    ends = _train(tiny_data, tmp_path / "full", *extra)
    # Every node decoded the same means: the global model is the same bits everywhere.
    assert len({s["evaluated"] for s in ends}) == 1, ends
    with pytest.raises(InjectedFault):
        _train(tiny_data, tmp_path / "part", *extra, fault="kind=raise,rank=1,step=13")
    saved = sorted(p.name for p in (tmp_path / "part" / "checkpoints").glob("step-*"))
    assert saved == [f"step-{k:08d}"], saved  # the resume starts mid-run, at step 10
    _train(tiny_data, tmp_path / "part", *extra, "--resume", "auto")
    assert_same_run(tmp_path / "full", tmp_path / "part")
    algo = json.loads((tmp_path / "full" / "config.json").read_text())["algo"]
    assert algo["bmuf_overlap"] and algo["bmuf_fragments"] == 2 and algo["wire"] == wire[0]
    train = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text()
             .splitlines() if '"train"' in line]
    # Every train record counts what crossed nodes: the warm-up's two SSGD steps (a ring's
    # share of the fp32 gradient, 2 (N - 1) / N x 4 P with one learner a node) and the
    # block syncs, which the wire carried.
    grads = 2 * 4 * sum(p.numel() for p in build_model("tiny", 260, 12).parameters())
    assert train and all(r["wire_bytes"] > 0 for r in train)
    for r in train:
        assert r["internode_bytes"] == r["internode_bytes_received"] == grads + r["wire_bytes"]
