"""Crash-safe checkpoints and resume under real mpirun: kills at every checkpoint-write phase,
a corrupted newest checkpoint, graceful stops on signals, ADPSGD's chunk accounting, and
resuming with another world size or algorithm."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests._commands import run_command
from tests._mpi import assert_ok
from tests.mpi._resume import (
    assert_same_run,
    final_state,
    kill_then_resume,
    run_args,
    train,
)

pytestmark = pytest.mark.mpi

# 28 steps per epoch on tiny_data at 2 x 4; checkpoints at 10, 20, 28 (epoch end), 30.
ARGS = ("--batch-size", "4", "--epochs", "2", "--max-steps", "34", "--checkpoint-every", "10",
        "--control-every", "5", "--optimizer", "sgd", "--momentum", "0.9")


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted SSGD run the interrupted ones must equal."""
    out = tmp_path_factory.mktemp("reference")
    train(2, tiny_data, out, *ARGS)
    return out


@pytest.mark.parametrize("phase", ["ckpt-data", "ckpt-manifest", "ckpt-rename"])
def test_kill_during_checkpoint_write_then_resume(phase, reference, tiny_data, tmp_path):
    # Rank 0 (the writer) dies in the middle of writing the step-20 checkpoint.
    res = kill_then_resume(2, tiny_data, tmp_path, *ARGS,
                           fault=f"kind=kill,rank=0,step=20,at={phase}")
    resumed_from = 20 if phase == "ckpt-rename" else 10
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{resumed_from:08d}'}" in res.stdout
    assert_same_run(reference, tmp_path)


def test_kill_of_another_rank_while_rank_0_writes_then_resume(reference, tiny_data,
                                                              tmp_path):
    # Rank 1 dies while rank 0 writes the step-20 checkpoint; the launcher then ends rank 0
    # wherever its write is. Either the step-20 checkpoint is complete or the step-10 one
    # stands: never a partial one, and the resumed run equals the uninterrupted one.
    res = kill_then_resume(2, tiny_data, tmp_path, *ARGS,
                           fault="kind=kill,rank=1,step=20,at=ckpt-wait")
    assert any(f"resumed from {tmp_path / 'checkpoints' / f'step-{s:08d}'}" in res.stdout
               for s in (10, 20)), res.stdout
    assert_same_run(reference, tmp_path)


def test_corrupted_newest_checkpoint_is_named_and_skipped(reference, tiny_data, tmp_path):
    res = train(2, tiny_data, tmp_path, *ARGS, env={"HADPSGD_FAULT": "kind=kill,rank=1,step=24"},
                ok=False)
    assert res.returncode != 0
    state = tmp_path / "checkpoints" / "step-00000020" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0xFF  # one flipped byte
    state.write_bytes(bytes(data))
    res = train(2, tiny_data, tmp_path, *ARGS, "--resume", "auto")
    assert "skipping checkpoint" in res.stdout and "step-00000020" in res.stdout
    assert "SHA-256" in res.stdout
    assert "step-00000010 at step 10" in res.stdout
    assert_same_run(reference, tmp_path)


def test_signal_checkpoints_at_agreed_step_and_resumes(reference, tiny_data, tmp_path):
    # Rank 1 receives SIGTERM before step 7: every rank stops after step 10 (the next
    # control point), rank 0 writes the checkpoint, and the job exits 75.
    res = train(2, tiny_data, tmp_path, *ARGS, env={"HADPSGD_FAULT": "kind=signal,rank=1,step=7"},
                ok=False)
    assert res.returncode == 75, res.output[-3000:]
    assert "SIGTERM received" in res.stderr
    assert "stop requested (SIGTERM on rank 1): stopped after step 10" in res.stdout
    assert final_state(tmp_path)["progress"]["global_step"] == 10
    train(2, tiny_data, tmp_path, *ARGS, "--resume", "auto")
    assert_same_run(reference, tmp_path)


def _chunks(data: tuple[Path, Path]) -> int:
    """Training chunks of the tiny set (the tails included)."""
    from hadpsgd.data import ChunkDataset

    return len(ChunkDataset(data[0], 21))


def test_adpsgd_resume_consumes_each_epoch_chunk_once(tiny_data, tmp_path):
    # Two super-learners of one learner each take batches from one shared pool at their own
    # pace; killed after global step 23, resumed from the checkpoint at step 20. Every
    # epoch's chunks are still trained exactly once over both ranks and both runs.
    args = ("--algo", "adpsgd", "--super-learner-size", "1", "--batch-size", "4", "--epochs",
            "2", "--checkpoint-every", "10")
    kill_then_resume(2, tiny_data, tmp_path, *args, fault="kind=kill,rank=1,step=23")
    # The trace key of a pooled batch is its slot, unique in the epoch. Slots trained after
    # the checkpoint and before the kill are trained again after the resume (by whichever
    # rank takes them): the same key with the same chunks, so the last record counts.
    slots = {}
    for path in (tmp_path / "trace").glob("chunks-rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            slots[(rec["epoch"], rec["step"])] = rec["chunks"]
    steps = _chunks(tiny_data) // 8  # global steps per epoch (global batch 8)
    for epoch in (0, 1):
        used = Counter(c for (e, _), chunks in slots.items() if e == epoch for c in chunks)
        assert max(used.values()) == 1, f"epoch {epoch}: a chunk was used twice"
        assert sum(used.values()) == steps * 8  # every slot of the epoch, none lost
    assert final_state(tmp_path)["progress"] == {"epoch": 2, "step_in_epoch": 0,
                                                "global_step": 2 * steps}


def test_resume_with_other_algo_or_world_size(tiny_data, tmp_path):
    assert_ok(run_command(2, run_args(tiny_data, tmp_path, "--max-steps", "12", "--batch-size",
                                  "4")))
    res = run_command(2, run_args(tiny_data, tmp_path, "--algo", "bmuf", "--resume", "auto",
                              "--batch-size", "4"), timeout=120)
    assert res.returncode == 2 and "--algo bmuf (the run has ssgd)" in res.stderr
    assert "--allow-resume-change" in res.stderr
    res = run_command(1, run_args(tiny_data, tmp_path, "--resume", "auto", "--batch-size", "4"),
                  timeout=120)
    assert res.returncode == 2 and "2 learners (now 1" in res.stderr
    res = run_command(1, run_args(tiny_data, tmp_path, "--resume", "auto", "--batch-size", "4",
                              "--allow-resume-change", "--max-steps", "16"))
    assert_ok(res)
    # 12 steps at global batch 8 = 96 chunks: the rest of the epoch starts after them.
    assert f"epoch 0, 96 of its {_chunks(tiny_data)} chunks trained" in res.stdout
    assert final_state(tmp_path)["progress"]["global_step"] == 16


def test_sigterm_to_the_launcher_stops_gracefully(tiny_data, tmp_path):
    # What a user's Ctrl-C or a scheduler's SIGTERM does to `python -m hadpsgd.launch`: it
    # becomes SIGUSR1 for mpirun (which Open MPI forwards without killing the ranks), every
    # rank stops at the same control point, rank 0 checkpoints, and the exit code is 75.
    import signal
    import subprocess
    import sys
    import time

    from hadpsgd.launch import launch_env
    from tests._mpi import MPI_TIMEOUT_S, ROOT, ranks_python

    env = launch_env(nprocs=2)
    env.update(ranks_python(env.get("PYTHONPATH", "")))
    env.setdefault("HADPSGD_TIMEOUT", "60")
    args = run_args(tiny_data, tmp_path, "--batch-size", "4", "--epochs", "30", "--log-every",
                    "2", "--control-every", "5")[2:]
    proc = subprocess.Popen([sys.executable, "-m", "hadpsgd.launch", "-n", "2", "--", *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + MPI_TIMEOUT_S
    while not (metrics.is_file() and '"train"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=MPI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the launcher did not stop after SIGTERM")
    assert proc.returncode == 75, out + err
    assert "stop requested (SIGUSR1 on rank 0, SIGUSR1 on rank 1)" in out, out + err
    stopped = final_state(tmp_path)["progress"]["global_step"]
    assert (stopped % 2 == 0 or stopped % 5 == 0) and stopped < 30 * 28  # a control point
    # Two steps past the stop show the resume where it stopped (a longer one adds nothing).
    res = train(2, tiny_data, tmp_path, "--batch-size", "4", "--epochs", "2", "--resume",
                "auto", "--max-steps", str(stopped + 2))
    assert f"at step {stopped}" in res.stdout
