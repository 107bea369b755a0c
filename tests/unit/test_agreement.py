"""``disagreements``: what the ranks' own settings disagree on, said before any acts."""

from __future__ import annotations

from hadpsgd.comm.objects import disagreements


def test_agreeing_ranks_say_nothing() -> None:
    assert disagreements([{"a": 1, "b": "x"}] * 5) == ""
    assert disagreements([{}]) == ""


def test_the_first_setting_that_differs_is_named_with_its_ranks() -> None:
    every = [{"backend": "mpi", "link": True}, {"backend": "gloo", "link": False},
             {"backend": "mpi", "link": True}]
    msg = disagreements(every)
    assert msg.startswith("the ranks disagree on backend: rank 0 has 'mpi', rank 1 'gloo';")
    assert "same options and HADPSGD_* environment" in msg


def test_many_ranks_are_cut_short() -> None:
    every = [{"n": 0}] + [{"n": 1}] * 9
    msg = disagreements(every)
    assert "rank 1 1, rank 2 1, rank 3 1, rank 4 1 and 5 more" in msg
