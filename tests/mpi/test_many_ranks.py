"""The main command at 16 ranks, on this 2-core machine: the mission's layout in small.

64 ranks take ~2.5 minutes to start here (docs/results.md); 16 take ~20 s, cheap enough to run
in CI: BMUF over two emulated nodes of 8 trains, evaluates, checkpoints and ends; the
start-up and memory reports are printed; an epoch of 7 steps is named with its fix.
"""

from __future__ import annotations

import json

import pytest

from tests._mpi import assert_ok, run_mpi
from tests.mpi._resume import run_args

pytestmark = pytest.mark.mpi


def test_sixteen_ranks_in_two_nodes_of_eight(tiny_data, tmp_path):
    res = run_mpi(16, run_args(tiny_data, tmp_path, "--algo", "bmuf", "--ranks-per-node", "8",
                               "--batch-size", "8", "--max-steps", "6"), timeout=300)
    assert_ok(res)
    out = res.stdout
    assert "16 learners on 2 emulated nodes [8, 8]" in out
    # 284 chunks / (8 x 16) = 2 steps an epoch: said at start, with a batch size that fits.
    assert "note: an epoch is only 2 steps" in out and "--batch-size 1 or less" in out
    assert "start-up " in out and "on the slowest rank" in out
    assert "memory per rank at the end: peak max " in out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if e["kind"] == "eval"] == [0, 2, 4, 6]
    assert (tmp_path / "checkpoints" / "step-00000006").is_dir()
