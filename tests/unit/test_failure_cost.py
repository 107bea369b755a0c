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
    assert got == {"to_next_step_s": 0.45, "recovery_s": 0.12, "learners_after": 3,
                   "failure_step": 20, "next_step": 21}


def test_next_step_says_what_is_missing() -> None:
    assert next_step("no fault line", [rec("failure", 5, 1.0)]) == \
        "fault not fired, a failure record"
    assert next_step(OUTPUT, [rec("train", 1, 1.0)]) == "fault fired, no failure record"
    assert next_step(OUTPUT, [rec("failure", 5, 101.0, recovery_s=0.1, learners=3),
                              rec("eval", 9, 101.1)]) == \
        "no trained step after the failure record"


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
                         "learners_after": 3}]}
    text = tables(result)
    assert "| SIGKILL | ssgd | 4 | 3 | off | failed: exit 1 |" in text
    assert "| SIGSTOP | adpsgd | 4 | 3 | on | 2.10 s | 0.20 s | 3 |" in text
