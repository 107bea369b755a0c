"""The old lab entry points under benchmarks/ forward to lab/ with the same flags."""

import os
import subprocess
import sys

import pytest

from tests._mpi import ROOT


@pytest.mark.parametrize("old, new", [
    ("benchmarks.project", "lab.project"),
    ("benchmarks.plots", "lab.plots"),
    ("benchmarks.sweep", "lab.sweep"),
    ("benchmarks.studies.tables", "lab.studies.tables"),
])
def test_old_module_forwards_to_lab(old, new):
    res = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert f"python -m {new}" in res.stdout  # the help of the lab command, flags and all


@pytest.mark.parametrize("study", ["a", "b"])
def test_old_study_script_forwards_to_lab(tmp_path, study):
    # A stand-in python records each call and answers the chunk count the scripts ask for.
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\necho 1000\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), TRAIN="t.h5", HELDOUT="h.h5", EPOCHS="3")
    res = subprocess.run(["bash", f"benchmarks/studies/study_{study}.sh", str(tmp_path / "sw")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr
    sweeps = [ln for ln in calls.read_text().splitlines() if ln.startswith("-m ")]
    assert sweeps and all(ln.startswith(f"-m lab.sweep --sweep-dir {tmp_path / 'sw'} ")
                          and "--epochs 3" in ln and "--train t.h5" in ln for ln in sweeps)


def test_benchmarks_import_lab_only_in_the_shims():
    shims = {"project.py", "plots.py", "sweep/__main__.py", "studies/tables.py"}
    bench = ROOT / "benchmarks"
    for path in bench.rglob("*.py"):
        if path.relative_to(bench).as_posix() not in shims:
            text = path.read_text()
            assert "from lab" not in text and "import lab" not in text, path
