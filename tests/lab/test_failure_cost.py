"""The failure-cost benchmark's pure parts: the figure it reads from a job, its cases, tables."""

from __future__ import annotations

from benchmarks.training.failure_cost import ALGOS, cases, next_step, run_steps, tables

OUTPUT = "[hadpsgd] fault injection: kind=kill rank=3 at=step step=20 pid=7 t=100.000\n"


def rec(kind: str, step: int, time: float, **extra: object) -> dict[str, object]:
    """A ``metrics.jsonl`` record."""
    return {"kind": kind, "step": step, "time": time, **extra}


def test_next_step_is_the_first_train_record_after_the_failure() -> None:
    recs = [rec("train", 19, 99.9), rec("train", 20, 100.05),
            rec("failure", 20, 100.2, recovery_s=0.12, learners=3),
            rec("eval", 20, 100.3), rec("train", 21, 100.45), rec("train", 22, 100.5)]
    got = next_step(OUTPUT, recs)
    assert got == {"detected_s": 0.2, "stall_s": 0.25, "to_next_step_s": 0.45,
                   "recovery_s": 0.12, "learners_after": 3, "failure_step": 20, "next_step": 21}


def test_a_pooled_run_that_trains_on_through_the_failure():
    # ADPSGD: the survivors train on; the recovery comes at the run's last meeting.
    recs = [rec("train", 19, 99.9), rec("train", 20, 100.01), rec("train", 24, 100.02),
            rec("train", 30, 100.1), rec("failure", 30, 100.3, recovery_s=0.17, learners=3),
            rec("eval", 31, 100.35)]
    got = next_step(OUTPUT, recs)
    assert got["stall_s"] == 0.2 and got["detected_s"] == 0.3  # the meeting's recovery
    assert got["to_next_step_s"] is None and got["next_step"] is None


def test_next_step_says_what_is_missing() -> None:
    assert next_step("no fault line", [rec("failure", 5, 1.0)]) == \
        "fault not fired, a failure record"
    assert next_step(OUTPUT, [rec("train", 1, 1.0)]) == "fault fired, no failure record"


def test_cases_cover_every_algorithm_at_4_and_8_and_rank_0() -> None:
    kills = cases({"kill"}, 20)
    assert {(c["algo"], c["nprocs"], c["rank"]) for c in kills} == \
        {(a, n, n - 1) for a in ALGOS for n in (4, 8)} | {(a, 4, 0) for a in ALGOS}
    frozen = cases({"frozen"}, 20)
    assert {(c["algo"], c["detector"]) for c in frozen} == \
        {(a, d) for a in ("ssgd", "adpsgd") for d in (False, True)}
    assert all(c["kind"] == "stop" for c in frozen)


def test_pooled_runs_are_long_enough_for_the_learners_own_step() -> None:
    # A pooled fault's step is the learner's own; the run's steps are the pool's.
    assert run_steps("ssgd", 20, 8) == 40
    assert run_steps("adpsgd", 20, 8) == 320


def test_tables_show_a_failed_case_as_failed() -> None:
    result = {"cases": [{"kind": "kill", "algo": "ssgd", "nprocs": 4, "rank": 3, "exit": 1,
                         "problem": "exit 1"},
                        {"kind": "stop", "algo": "adpsgd", "nprocs": 4, "rank": 3,
                         "detector": True, "to_next_step_s": 2.1, "recovery_s": 0.2,
                         "learners_after": 3, "stall_s": 2.0, "detected_s": 2.05},
                        {"kind": "kill", "algo": "adpsgd", "nprocs": 4, "rank": 3,
                         "to_next_step_s": None, "recovery_s": 0.17, "learners_after": 3,
                         "stall_s": 0.2, "detected_s": 0.3}]}
    text = tables(result)
    assert "| SIGKILL | ssgd | 4 | 3 | off | failed: exit 1 | | | | |" in text
    assert "| SIGSTOP | adpsgd | 4 | 3 | on | 2.00 s | 2.10 s | 2.05 s | 0.20 s | 3 |" in text
    assert "| SIGKILL | adpsgd | 4 | 3 | off | 0.20 s | run ended | 0.30 s | 0.17 s | 3 |" \
        in text
