"""``python -m hadpsgd.run --algo bmuf`` under mpirun: checkpoint, resume bit for bit."""

import json
from pathlib import Path

import pytest
import torch

from tests._commands import run_command
from tests._mpi import assert_ok, run_mpi

pytestmark = pytest.mark.mpi


def _train(data: tuple[Path, Path], out: Path, *extra: str, fault: str = "") -> dict | None:
    from hadpsgd.train import latest_checkpoint, load_checkpoint

    # Two emulated nodes of one learner: N = 2 super-learners, eta = 1 - 1/2.
    run = run_mpi if fault else run_command  # a kill ends a process: launched
    res = run(2, ["-m", "hadpsgd.run", "--train", str(data[0]), "--heldout", str(data[1]),
                      "--preset", "tiny", "--out-dir", str(out), "--no-progress", "--algo",
                      "bmuf", "--optimizer", "adam", "--beta1", "0.5", "--lr", "0.002",
                      "--warmup-epochs", "0", "--batch-size", "8", "--epochs", "3",
                      "--sync-period", "3", "--bmuf-warmup-steps", "2", *extra],
                  env={"HADPSGD_RANKS_PER_NODE": "1", "HADPSGD_FAULT": fault,
                       "HADPSGD_TRACE_CHUNKS": str(out / "trace")})
    if fault:
        assert res.returncode != 0 and "fault injection" in res.output, res.output[-3000:]
        return None
    assert_ok(res)
    assert "bmuf on 2 learners (2 nodes)" in res.stdout
    return load_checkpoint(latest_checkpoint(out / "checkpoints"))


def test_resume_is_bit_exact(tiny_data, tmp_path):
    # ~15 steps per epoch: the checkpoint at step 10 is mid-block (tau = 3: 2 warm-up steps,
    # blocks end at 5 and 8, then 2 steps); the run continues across an epoch boundary
    # (evaluation, LR change, reshuffle) to step 20, where finish() closes the last block.
    # The run is killed at step 13 and resumed from step 10; parameters, moments, filter
    # state and the chunk sequence must equal the uninterrupted run's. A run that never
    # checkpoints mid-run must end identically too: neither checkpoints nor evaluations
    # cut a block short, so --checkpoint-every does not change the trajectory.
    from tests.mpi._resume import assert_same_run

    k = 10
    full = _train(tiny_data, tmp_path / "full", "--max-steps", str(2 * k),
                  "--checkpoint-every", str(k))
    killed = _train(tiny_data, tmp_path / "part", "--max-steps", str(2 * k),
                    "--checkpoint-every", str(k), fault="kind=kill,rank=0,step=13")
    assert killed is None
    _train(tiny_data, tmp_path / "part", "--max-steps", str(2 * k), "--checkpoint-every",
           str(k), "--resume", "auto")
    assert_same_run(tmp_path / "full", tmp_path / "part")
    plain = _train(tiny_data, tmp_path / "plain", "--max-steps", str(2 * k))
    for key in ("model", "eval_model"):
        for name, value in full[key].items():
            assert torch.equal(value, plain[key][name]), (key, name)
    # A run ended by --max-steps mid-block (step 10: its closing sync ends a partial block)
    # and then extended equals the uninterrupted run: its final checkpoint holds the state
    # before the closing sync for the resume, the closed global model for deployment.
    # (Before, the closing sync was what it resumed from: every tensor differed.)
    _train(tiny_data, tmp_path / "ext", "--max-steps", str(k))
    _train(tiny_data, tmp_path / "ext", "--max-steps", str(2 * k), "--resume", "auto")
    assert_same_run(tmp_path / "full", tmp_path / "ext")
    # The mid-block checkpoint holds one local state per worker: another layout is refused
    # (naming the fix) before anything is trained.
    mid = tmp_path / "full" / "checkpoints" / f"step-{k:08d}"
    # Sharded: each node leader wrote its own part; the manifest checksums every part.
    manifest = json.loads((mid / "MANIFEST.json").read_text())
    assert sorted(manifest["files"]) == ["node-00000.pt", "node-00001.pt", "state.pt"]
    assert manifest["node_parts"] == 2
    assert "node_states" not in torch.load(mid / "state.pt", weights_only=True)
    from hadpsgd.forward.model import load_model

    loaded = load_model(mid)  # forward verifies every part and takes the global model
    assert loaded.checkpoint == mid and loaded.weights == "eval_model"
    res = run_command(2, ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
                          str(tiny_data[1]), "--preset", "tiny", "--out-dir", str(tmp_path / "x"),
                          "--no-progress", "--algo", "bmuf", "--resume", str(mid)],
                      env={"HADPSGD_RANKS_PER_NODE": "2"})
    assert res.returncode == 2, res.output[-3000:]
    assert "2 super-learners (nodes) each with its own state (now 1; the same -np and " \
        "--ranks-per-node" in res.stderr
    bmuf = full["algo"]["bmuf"]
    assert bmuf["started"] and bmuf["num_syncs"] >= 5 and bmuf["rho"] > 3
    step = full["algo"]["optimizer"]["state"][0]["step"]
    assert float(step) != round(float(step))  # corrected: Adam's k is fractional
    # the global model (evaluated) differs from the Nesterov start point (local)
    assert any(not torch.equal(full["model"][n], full["eval_model"][n]) for n in full["model"])


def test_default_recipe_and_one_node_is_reported(tiny_data, tmp_path):
    import json

    # Two ranks on one (real) node: a single super-learner, which the run must say.
    res = run_command(2, ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
                          str(tiny_data[1]), "--preset", "tiny", "--out-dir", str(tmp_path),
                          "--no-progress", "--algo", "bmuf", "--max-steps", "3"])
    assert_ok(res)
    assert res.stderr.count("[hadpsgd] warning: bmuf with a single super-learner") == 1
    assert "--ranks-per-node 1" in res.stderr
    cfg = json.loads((tmp_path / "config.json").read_text())
    # The recipe, resolved and recorded: SGD at the global rate, its momentum kept, clipped.
    assert (cfg["optim"]["optimizer"], cfg["algo"]["bmuf_worker_lr"], cfg["algo"]["adam_moments"],
            cfg["optim"]["lr"], cfg["optim"]["max_grad_norm"]) == ("sgd", "global", "local", 0.5,
                                                                  1.0)


@pytest.mark.parametrize("wire", [("int8",)], ids=["int8"])
def test_overlapped_streaming_compressed_resume_is_bit_exact(tiny_data, tmp_path, wire):
    # The issue-18 syncs through the main command: two fragments (blocks of 3 steps,
    # staggered: fragment 0 ends its first block after 1 step), each average applied one
    # block late, compressed deltas with error feedback. The checkpoint at step 10 holds a
    # mean in flight and the wire's residuals (per worker); killed at 13 and resumed, the
    # run must end bit for bit as the uninterrupted one. Under mpirun for int8 (MPI's side
    # channel in its background thread, a real kill); int4, sign and top-k (issue 45, whose
    # residuals hold most of every delta) run the same check on learners as threads:
    # tests/unit/test_bmuf_wire_resume_threads.py.
    import json

    from tests.mpi._resume import assert_same_run

    # BMUF-Adam on these wires runs only with the moments chosen (issue 57's refusal):
    # the corrected ones, sent on the wire, are what the resume must restore exactly.
    moments = () if wire[0] == "int8" else ("--adam-moments", "corrected")
    k, extra = 10, ("--bmuf-overlap", "--bmuf-fragments", "2", "--wire", *wire, *moments)
    full = _train(tiny_data, tmp_path / "full", "--max-steps", str(2 * k),
                  "--checkpoint-every", str(k), *extra)
    assert _train(tiny_data, tmp_path / "part", "--max-steps", str(2 * k),
                  "--checkpoint-every", str(k), *extra, fault="kind=kill,rank=1,step=13") is None
    _train(tiny_data, tmp_path / "part", "--max-steps", str(2 * k), "--checkpoint-every",
           str(k), "--resume", "auto", *extra)
    assert_same_run(tmp_path / "full", tmp_path / "part")
    mid = json.loads((tmp_path / "full" / "config.json").read_text())["algo"]
    assert mid["bmuf_overlap"] and mid["bmuf_fragments"] == 2 and mid["wire"] == wire[0]
    train = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text()
             .splitlines() if '"train"' in line]
    assert train and all(r["wire_bytes"] > 0 for r in train)  # bytes on the wire, logged
    assert len(full["algo"]["bmuf"]["fragments"]) == 2
    # Every train record counts what crossed nodes, both ways (issue 45): the warm-up's two
    # SSGD steps (a ring's share of the fp32 gradient, 2 (N - 1) / N x 4 P with one learner
    # a node) and the block syncs. The final line compares them with SSGD in fp32.
    from hadpsgd.models import build_model

    grads = 2 * 4 * sum(p.numel() for p in build_model("tiny", 260, 12).parameters())
    for r in train:
        assert r["internode_bytes"] == r["internode_bytes_received"] == grads + r["wire_bytes"]
    log = (tmp_path / "full" / "train.log").read_text()
    assert "per trained frame" in log and "SSGD in fp32 would have sent" in log, log[-2000:]


def test_a_leader_dying_with_its_part_written_leaves_the_previous_checkpoint(tiny_data,
                                                                             tmp_path):
    """Node 1's leader dies after writing its part of the mid-block checkpoint at step 10:
    nothing is published (no step-00000010, ``latest`` still names step 5, the block-boundary
    checkpoint), and --resume auto from step 5 ends bit-identical to an uninterrupted run."""
    from tests.mpi._resume import assert_same_run

    common = ("--max-steps", "14", "--checkpoint-every", "5")
    _train(tiny_data, tmp_path / "full", *common)
    assert _train(tiny_data, tmp_path / "part", *common,
                  fault="kind=kill,rank=1,step=10,at=ckpt-part") is None
    ckpts = tmp_path / "part" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000005"
    assert not (ckpts / "step-00000010").exists()
    _train(tiny_data, tmp_path / "part", *common, "--resume", "auto")
    assert_same_run(tmp_path / "full", tmp_path / "part")
