"""``--on-failure continue`` under ``mpirun --with-ft ulfm``: the survivors go on.

Launched through ``python -m hadpsgd.launch``, which adds ULFM (and the heartbeat detector
where a test sets ``HADPSGD_FT_DETECTOR=1``).
Every launch ends within its wall-clock limit (a hang is a failure).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests._mpi import LAUNCH_TRIES, ROOT, MPIResult, job_env, launcher_failed_to_start

pytestmark = pytest.mark.mpi


def _launch(nprocs: int, data: tuple[Path, Path], out: Path, *extra: str,
            fault: str = "", timeout: str = "60",
            env_extra: dict[str, str] | None = None) -> MPIResult:
    """``python -m hadpsgd.launch -n N`` of a tiny run that continues on failure."""
    env = job_env(nprocs)
    env.update(env_extra or {})
    env.update({"HADPSGD_TIMEOUT": timeout, "HADPSGD_FAULT": fault,
                "HADPSGD_TRACE_CHUNKS": str(out / "trace")})
    cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), "--",
           "--train", str(data[0]), "--heldout", str(data[1]), "--preset", "tiny",
           "--out-dir", str(out), "--no-progress", "--batch-size", "2",
           "--on-failure", "continue", *extra]
    for _ in range(LAUNCH_TRIES):
        # Its own session: a launch that hangs is killed with mpirun and every rank under it.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            # Which process stayed (a rank, mpirun, the launcher), before they are killed.
            left = subprocess.run(["ps", "-s", str(proc.pid), "-o", "pid,ppid,stat,wchan:24,"
                                   "etime,args", "--forest"], capture_output=True,
                                  text=True).stdout
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish (hang?)\n{stdout}\n{stderr}\n"
                        f"processes left:\n{left}")
        if proc.returncode == 0 or not (launcher_failed_to_start(stdout + stderr)
                                        or _crashed_in_mpi_init(env, stdout + stderr)):
            break
    return MPIResult(proc.returncode, stdout, stderr)


def _crashed_in_mpi_init(env: dict[str, str], output: str) -> bool:
    """Open MPI's heartbeat detector (``HADPSGD_FT_DETECTOR=1``) crashed the job inside
    ``MPI_Init``, before any rank reached hadpsgd's first line (docs/failures.md: about one
    launch in seven on a loaded machine; no rank ran the test's code, so it is launched
    again, as a launcher that failed to start is)."""
    return (env.get("HADPSGD_FT_DETECTOR") == "1" and "[hadpsgd] comm:" not in output
            and ("Segmentation fault" in output or "MPI_ERR_INTERN" in output))


def _records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _final_world(out: Path) -> int:
    from hadpsgd.train import latest_checkpoint
    from hadpsgd.train.checkpoint import read_manifest

    return read_manifest(latest_checkpoint(out / "checkpoints"))["world_size"]


def test_ssgd_goes_on_without_a_killed_learner_and_trains_the_epoch(tiny_data, tmp_path):
    """Rank 2 of 4 is SIGKILLed at step 20 of a one-epoch SSGD run (35 steps): the 3
    survivors go on from the control point at step 20 (or 15), finish the epoch with exit 0
    and a checkpoint of 3 learners; one line names the dead rank; over the epoch's final
    trajectory every chunk is trained exactly once but for fewer than one global batch left
    over at the end."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "1", "--control-every", "5",
                  fault="kind=kill,rank=2,step=20")
    assert res.returncode == 0, res.output[-4000:]
    assert "failure: learner(s) rank 2" in res.stdout and "3 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["learners"] == 3 and failure["lost"] == [2]
    assert _final_world(out) == 3
    chunks = _final_trajectory(out, dead=2, kept=failure["step"])
    from hadpsgd.data import ChunkDataset

    total = len(ChunkDataset(tiny_data[0], 21))
    new_global = 3 * 2
    assert max(chunks.values()) == 1  # the survivors go on right after the chunks trained
    assert total - len(chunks) < new_global  # only the last incomplete global batch
    # The byte counters go on over the recovery (the run's last line counts them all).
    _assert_counters_go_on(out, "grad_wire_bytes")


def _final_trajectory(out: Path, dead: int, kept: int) -> Counter:
    """How often each chunk was trained in the final trajectory of a run that lost ``dead``:
    the survivors' records (a step retrained overwrites its first record), the dead rank's
    up to step ``kept``, the last whose progress is in the model the survivors went on
    from."""
    chunks: Counter = Counter()
    for path in (out / "trace").glob("chunks-rank*.jsonl"):
        rank = int(path.stem.removeprefix("chunks-rank"))
        steps = {}
        for rec in map(json.loads, path.read_text().splitlines()):
            steps[rec["step"]] = rec["chunks"]
        for step, batch in steps.items():
            if rank != dead or step <= kept:
                chunks.update(batch)
    return chunks


def _assert_counters_go_on(out: Path, *names: str) -> None:
    """Rank 0's logged byte counters never go back, failure or not (before, a recovery
    started them again at 0)."""
    train = _records(out, "train")
    for name in names:
        seen = [r[name] for r in train]
        assert seen[-1] > 0 and seen == sorted(seen), (name, seen)


def test_bmuf_super_learner_that_lost_a_member_leaves_and_the_others_go_on(tiny_data,
                                                                           tmp_path):
    """BMUF on 3 emulated nodes of 2: rank 2 dies, its node's other learner leaves as a
    whole (exit 0), the 2 other super-learners go on to the end with 4 learners."""
    out = tmp_path / "run"
    res = _launch(6, tiny_data, out, "--algo", "bmuf", "--ranks-per-node", "2",
                  "--max-steps", "24", fault="kind=kill,rank=2,step=12")
    assert res.returncode == 0, res.output[-4000:]
    assert "super-learner 1 lost learner(s) rank 2" in res.stdout
    assert "4 learners go on (2 nodes" in res.stdout
    assert _final_world(out) == 4
    assert _records(out, "eval")[-1]["step"] == 24


def test_bmuf_survivors_retrain_the_block_in_flight(tiny_data, tmp_path):
    """BMUF on 4 super-learners of 1, tau 10, rank 2 SIGKILLed at step 18 of a one-epoch
    run: the snapshot the survivors agree on (the control point at step 15) holds the
    global model of the block sync at step 10, so they go on from step 10's data position,
    and the line says so. Over the epoch's final trajectory every chunk is in the final
    model once: the dead learner's steps 11-18 and the survivors' own, which no model had
    taken in, are trained again (before, the data went on after step 15's chunks, and those
    of steps 11-15 were in no model). The block syncs' byte counter goes on over the
    recovery."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--algo", "bmuf", "--ranks-per-node", "1",
                  "--sync-period", "10", "--control-every", "5", "--epochs", "1",
                  fault="kind=kill,rank=2,step=18")
    assert res.returncode == 0, res.output[-4000:]
    failure, = _records(out, "failure")
    assert failure["step"] == 15, failure  # the control point before the fault
    line = res.stdout[res.stdout.index("failure: learner(s) rank 2"):]
    assert "whose global model is of step 10: the block in flight (steps 11-" in line, line
    chunks = _final_trajectory(out, dead=2, kept=10)
    from hadpsgd.data import ChunkDataset

    total = len(ChunkDataset(tiny_data[0], 21))
    assert max(chunks.values()) == 1
    assert total - len(chunks) < 3 * 2  # only the last incomplete global batch
    _assert_counters_go_on(out, "wire_bytes", "internode_bytes")


def test_adpsgd_goes_on_from_its_replicas_and_trains_every_chunk_once(tiny_data, tmp_path):
    """Flat ADPSGD on 4 learners, rank 2 SIGKILLed at its step 10 of a one-epoch run: the 3
    survivors go on from their own replicas with the ring re-formed, the slots the dead had
    taken go back to the pool, and over the epoch the survivors train every chunk exactly
    once (the dead learner's chunks included, none twice)."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--algo", "adpsgd", "--super-learner-size", "1",
                  "--epochs", "1", fault="kind=kill,rank=2,step=10")
    assert res.returncode == 0, res.output[-4000:]
    assert "failure: learner(s) rank 2" in res.stdout and "3 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["learners"] == 3 and failure["lost"] == [2]
    assert failure["returned_slots"] >= 1  # at least the slot the dead one held
    assert _final_world(out) == 3
    survivors: Counter = Counter()
    dead: set[int] = set()
    for path in (out / "trace").glob("chunks-rank*.jsonl"):
        rank = int(path.stem.removeprefix("chunks-rank"))
        for rec in map(json.loads, path.read_text().splitlines()):
            if rank == 2:
                dead.update(rec["chunks"])
            else:
                survivors.update(rec["chunks"])
    from hadpsgd.data import ChunkDataset

    total = len(ChunkDataset(tiny_data[0], 21))
    assert max(survivors.values()) == 1  # no survivor's chunk twice
    assert dead <= set(survivors)  # the dead learner's chunks were trained again
    assert total - len(survivors) < 3 * 2  # only the last incomplete global batch
    # The gossip's counter over the recovery: rank 0's train records come before the failure
    # (and, on a loaded machine, may hold no round yet), so the survivors' closing `learners`
    # record (rank 0 first) is the value after it; some survivor must have gossiped.
    seen = [r["wire_bytes"] for r in _records(out, "train")]
    final = _records(out, "learners")[-1]["wire_bytes"]
    seen.append(final[0])
    assert seen == sorted(seen) and sum(final) > 0, (seen, final)


def _detected_after(out: Path, output: str) -> float:
    """Seconds from the injected fault to the survivors' `failure` record."""
    from tests.mpi.test_faults import fault_time

    return _records(out, "failure")[0]["time"] - fault_time(output)


def test_a_frozen_learner_is_found_by_the_heartbeat_detector_well_before_the_deadline(
        tiny_data, tmp_path):
    """Rank 2 of 4 SIGSTOPs itself at step 10 under a 60 s deadline: the heartbeat detector
    that hadpsgd.launch turns on finds it (about 2 s on an idle machine), the survivors drop
    and kill it, go on to the end of the epoch and the job ends with exit 0 (nothing waits
    for the frozen process). Before, it was found at the deadline only."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "1", "--control-every", "5",
                  fault="kind=stop,rank=2,step=10", timeout="60",
                  env_extra={"HADPSGD_FT_DETECTOR": "1"})
    assert res.returncode == 0, res.output[-4000:]
    took = _detected_after(out, res.output)
    print(f"FROZEN: dropped {took:.2f} s after the fault")
    assert took < 30, f"found {took:.1f} s after the fault, not well before the 60 s deadline"
    assert "did not answer" not in res.output  # not at a deadline
    assert "3 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["lost"] == [2] and _final_world(out) == 3


def test_a_learner_frozen_in_start_up_ends_the_job_within_seconds_naming_it(tiny_data,
                                                                           tmp_path):
    """Rank 1 of 2 SIGSTOPs itself in start-up's data checks: there is no agreed state to go
    on from, so the detector's finding ends the job (exit 1), well before the 60 s
    deadline, with a line naming the frozen learner instead of a bare MPI_ERR_PROC_FAILED
    traceback."""
    res = _launch(2, tiny_data, tmp_path / "run", "--max-steps", "3",
                  fault="kind=stop,rank=1,at=startup-data", timeout="60",
                  env_extra={"HADPSGD_FT_DETECTOR": "1"})
    ended = time.time()
    from tests.mpi.test_faults import fault_time

    took = ended - fault_time(res.output)
    assert res.returncode == 1, res.output[-4000:]
    assert took < 30, f"the job took {took:.1f} s to end\n{res.output[-4000:]}"
    assert re.search(r"hadpsgd: rank 0: error: rank 1 \(\S+\) failed \(dead, or frozen and "
                     r"found by MPI's failure detector\) outside training", res.stderr), \
        res.output[-4000:]
    assert "Traceback" not in res.output


def test_without_the_detector_a_frozen_learner_is_found_at_the_deadline_and_killed(
        tiny_data, tmp_path):
    """Where the detector is off (the default; a plain mpirun --with-ft ulfm; the user's
    OMPI_MCA_mpi_ft_detector=false, which the launcher keeps): rank 2 of 4 SIGSTOPs itself
    at step 10, its peers' deadline (4 s) names it, a learner on its host kills it, and the
    3 others go on to the end of the epoch."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "1", "--control-every", "5",
                  fault="kind=stop,rank=2,step=10", timeout="4",
                  env_extra={"OMPI_MCA_mpi_ft_detector": "false", "HADPSGD_FROZEN_S": "0"})
    assert res.returncode == 0, res.output[-4000:]
    assert "mpi_ft_detector" not in res.stdout.splitlines()[0]  # the launcher's command
    assert "did not answer: dead or frozen); killed by a learner on its host" in res.output
    assert "3 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["lost"] == [2] and _final_world(out) == 3


OWN_ERRORS = {
    "raise": ("kind=raise,rank=1,step=10", ["--algo", "ssgd"], 1),
    "ckpt-write": ("kind=raise,rank=0,step=10,at=ckpt-data", ["--algo", "ssgd"], 0),
    "raise-gossip": ("kind=raise-gossip,rank=2,step=10",
                     ["--algo", "adpsgd", "--super-learner-size", "1"], 2),
}


@pytest.mark.parametrize("case", list(OWN_ERRORS))
def test_a_learners_own_error_ends_every_learner_within_seconds_with_its_message(
        case, tiny_data, tmp_path):
    """A learner's own error (an exception in its step, in a checkpoint write on rank 0, in
    ADPSGD's gossip thread) is no lost learner: every rank ends within seconds, well before
    the 60 s deadline, with exit 1 and one line carrying the raising rank's message; nobody
    is taken for frozen or killed, and nobody goes on. (Under ULFM an ``MPI_Abort`` ends no
    peer: before, the peers waited for the deadline, blamed a frozen learner and said that
    the others go on.)"""
    fault, algo, rank = OWN_ERRORS[case]
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "2", "--control-every", "5",
                  "--checkpoint-every", "10", *algo, fault=fault)
    ended = time.time()
    from tests.mpi.test_faults import fault_time

    took = ended - fault_time(res.output)
    print(f"OWN ERROR {case}: exit {res.returncode}, job ended {took:.1f} s after the fault")
    assert res.returncode == 1, res.output[-4000:]
    assert took < 30, f"the job took {took:.1f} s to end\n{res.output[-4000:]}"
    said = re.findall(r"hadpsgd: error: learner\(s\) failed with their own error, not a lost "
                      rf"learner: rank {rank} \(\S+\): (.*injected fault[^.]*)", res.stderr)
    assert len(said) == 1, res.output[-4000:]  # once, by one peer
    assert "did not answer" not in res.output and "is frozen" not in res.output
    assert "the others go on" not in res.output
    assert not _records(out, "failure")


def test_below_min_learners_the_survivors_state_is_checkpointed_and_resumed(tiny_data,
                                                                           tmp_path):
    """Two of 4 learners are killed with --min-learners 3: the job stops with exit 1, but the
    2 survivors first write the control point they agreed on as a checkpoint of their world
    and a `failure` record, and the line names that checkpoint and the resume; a resume at
    the old -np goes on from it. (Before, nothing was written and the line said to resume
    from a last checkpoint that did not exist.)"""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "1", "--control-every", "5",
                  "--min-learners", "3", fault="kind=kill,rank=1,step=12;kind=kill,rank=2,step=12")
    assert res.returncode == 1, res.output[-4000:]
    failure = _records(out, "failure")[-1]
    assert failure["stopped"] == "below --min-learners 3" and failure["learners"] == 2
    from hadpsgd.train import latest_checkpoint
    from hadpsgd.train.checkpoint import read_manifest, verify_checkpoint

    latest = latest_checkpoint(out / "checkpoints")
    verify_checkpoint(latest)
    manifest = read_manifest(latest)
    assert manifest["world_size"] == 2 and manifest["step"] == failure["step"]
    assert re.search(rf"fewer than --min-learners 3: stopping\. Their state at step "
                     rf"{failure['step']} \(the control point every survivor agreed on\) is "
                     rf"checkpoint {re.escape(str(latest))}: continue with --resume auto "
                     r"--allow-resume-change np", res.stderr), res.output[-4000:]
    res = _launch(4, tiny_data, out, "--epochs", "1", "--control-every", "5", "--resume",
                  "auto", "--allow-resume-change", "np", "--max-steps", str(failure["step"] + 4))
    assert res.returncode == 0, res.output[-4000:]
    assert f"resumed from {latest}" in res.stdout


def test_without_ulfm_the_option_is_refused_before_training(tiny_data, tmp_path):
    from tests._mpi import run_mpi
    from tests.mpi._resume import run_args

    res = run_mpi(2, run_args(tiny_data, tmp_path / "run", "--on-failure", "continue",
                              "--max-steps", "2"))
    assert res.returncode == 2 and "mpirun --with-ft ulfm" in res.stderr


def test_adpsgd_failure_record_is_at_the_step_the_log_names_and_steps_go_on_after_it(
        tiny_data, tmp_path):
    """Flat ADPSGD on 4 learners meets at every 5 steps; rank 2 dies at its step 12: the
    `failure` record (the plot's mark) is at the step the log line names, the furthest
    survivor's (past the last meeting at 10), and the survivors' steps go on after it."""
    import re

    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--algo", "adpsgd", "--super-learner-size", "1",
                  "--epochs", "1", "--checkpoint-every", "5", "--log-every", "3",
                  fault="kind=kill,rank=2,step=12")
    assert res.returncode == 0, res.output[-4000:]
    gone_at = int(re.search(r"gone at step (\d+)", res.stdout)[1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at, failure = next((i, r) for i, r in enumerate(records) if r["kind"] == "failure")
    assert failure["step"] == gone_at > 10  # not the last meeting's step
    steps = [r["step"] for r in records[at + 1:] if r["kind"] == "train"]
    assert steps and steps[0] > gone_at, steps
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), steps


def test_an_intra_node_torch_collective_is_refused_at_start_naming_the_fix(tiny_data,
                                                                           tmp_path):
    """--on-failure continue with gloo inside a node (the same sequence as NCCL's on GPUs,
    tests/gpu/test_gpu_elastic.py): a dead learner's node-mates would wait in a collective
    that ULFM cannot interrupt (NCCL: a kernel that never ends, the job dying at the
    watchdog; gloo: the whole deadline). Refused before training with exit 2, naming the
    backend and --intra-backend mpi; nothing is trained."""
    out = tmp_path / "run"
    res = _launch(2, tiny_data, out, "--max-steps", "4", "--intra-backend", "gloo")
    assert res.returncode == 2, res.output[-4000:]
    assert ("--on-failure continue cannot go on through a failure with gloo inside a node"
            in res.stderr and "Use --intra-backend mpi" in res.stderr), res.output[-4000:]
    assert not (out / "checkpoints").exists()



def test_bmuf_with_every_super_learner_damaged_stops_with_exit_1(tiny_data, tmp_path):
    """The soak's round-3 finding: 2 super-learners of 2, a learner of each killed at one
    step. Every super-learner leaves as a whole, so nobody goes on: the job has failed (exit
    1, one line saying so and how to resume). Before, every leaver exited 0 saying "the
    other 0 learners ... checkpoint their state and stop", and nothing did."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--algo", "bmuf", "--ranks-per-node", "2", "--epochs", "1",
                  fault="kind=kill,rank=0,step=6;kind=kill,rank=2,step=6")
    assert res.returncode == 1, res.output[-4000:]
    assert res.stderr.count("every super-learner lost a member: none can go on") == 1, \
        res.output[-4000:]
    assert "the other 0 learners" not in res.output
