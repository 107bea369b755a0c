"""Two runs in one ``--out-dir`` at once: the second is refused, naming the first."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from hadpsgd.launch import launch_env
from hadpsgd.run import EXIT_STOPPED
from tests._commands import run_command
from tests._mpi import MPI_TIMEOUT_S, ROOT, ranks_python
from tests.mpi._resume import run_args

pytestmark = pytest.mark.mpi


def test_a_second_run_in_a_live_run_directory_is_refused_naming_the_first(tiny_data,
                                                                         tmp_path):
    """The first run (slowed to 0.25 s a step, far more steps than the test takes) holds the
    directory; a second start there with another seed, and a --resume auto, both exit 2
    naming the first (host, pid, start) before writing anything; the first, then stopped as a
    user's Ctrl-C stops it (SIGTERM to ``python -m hadpsgd.launch``), ends with its own
    config.json. (It once ran a fixed 12 s: on a busy machine it had ended before the second
    start got past its imports, and nothing held the directory.)"""
    out = tmp_path / "race"
    env = launch_env(nprocs=2)
    env.update(ranks_python(env.get("PYTHONPATH", "")))
    env.setdefault("HADPSGD_TIMEOUT", "60")
    env["HADPSGD_EMULATE_STEP"] = "ms=250"
    args = run_args(tiny_data, out, "--max-steps", "4000", "--checkpoint-every", "2",
                    "--seed", "1", "--batch-size", "4", "--control-every", "2")[2:]
    first = subprocess.Popen([sys.executable, "-m", "hadpsgd.launch", "-n", "2", "--", *args],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + MPI_TIMEOUT_S
        while not (out / "config.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        for extra in (["--seed", "2", "--overwrite"], ["--resume", "auto"]):
            # A refusal (exit 2): a warm world's ranks take it as a launch's would.
            res = run_command(2, run_args(tiny_data, out, "--max-steps", "30",
                                          "--batch-size", "4", *extra))
            assert res.returncode == 2, res.output[-3000:]
            assert "is in use by another run: pid" in res.stderr and "on host" in res.stderr
            assert "Traceback" not in res.output
        assert first.poll() is None, "the first run ended before the checks: nothing held it"
        first.send_signal(signal.SIGTERM)
        out_text, err_text = first.communicate(timeout=MPI_TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == EXIT_STOPPED, out_text[-3000:] + err_text[-3000:]
    assert '"seed": 1' in (out / "config.json").read_text()
