"""Two runs in one ``--out-dir`` at once: the second is refused, naming the first."""

from __future__ import annotations

import threading
import time

import pytest

from tests._mpi import assert_ok, run_mpi
from tests.mpi._resume import run_args

pytestmark = pytest.mark.mpi


def test_a_second_run_in_a_live_run_directory_is_refused_naming_the_first(tiny_data,
                                                                         tmp_path):
    """The first run (slowed to 0.25 s a step, 48 steps) holds the directory; a second start there
    with another seed, and a --resume auto, both exit 2 naming the first (host, pid, start)
    before writing anything; the first ends normally with its own config.json."""
    out = tmp_path / "race"
    first: dict = {}

    def run_first() -> None:
        first["res"] = run_mpi(2, run_args(tiny_data, out, "--max-steps", "48",
                                           "--checkpoint-every", "2", "--seed", "1",
                                           "--batch-size", "4"),
                               env={"HADPSGD_EMULATE_STEP": "ms=250"})

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not (out / "config.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "config.json").exists(), "the first run did not start"
        for extra in (["--seed", "2", "--overwrite"], ["--resume", "auto"]):
            res = run_mpi(2, run_args(tiny_data, out, "--max-steps", "30", "--batch-size",
                                      "4", *extra))
            assert res.returncode == 2, res.output[-3000:]
            assert "is in use by another run: pid" in res.stderr and "on host" in res.stderr
            assert "Traceback" not in res.output
    finally:
        thread.join(timeout=300)
    assert_ok(first["res"])
    assert '"seed": 1' in (out / "config.json").read_text()
