"""The house around the package: imports run one way, and no two scripts import each other.

``benchmarks/`` never imports ``lab/`` (the lab sits on top of it), not even to forward an old
command; ``scripts/`` holds no import circle. The lab's commands and study scripts run
from their own paths.
"""

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._mpi import ROOT


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, by its absolute name (TYPE_CHECKING included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_benchmarks_never_import_lab():
    bench = ROOT / "benchmarks"
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted(bench.rglob("*.py"))
           for m in sorted(_imported(p)) if m == "lab" or m.startswith("lab.")]
    assert not bad, "\n".join(bad)
    shells = [p.relative_to(ROOT) for p in bench.rglob("*.sh") if "lab/" in p.read_text()]
    assert not shells, shells


def test_no_import_circle_in_scripts():
    # scripts/ is no package: its modules import each other by their bare names.
    scripts = ROOT / "scripts"
    names = {p.stem for p in scripts.glob("*.py")}
    graph = {p.stem: {m for m in _imported(p) if m in names} for p in scripts.glob("*.py")}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        raise AssertionError("import circle in scripts/: " + " -> ".join(err.args[1])) from None


@pytest.mark.parametrize("module", ["lab.project", "lab.plots", "lab.sweep",
                                    "lab.studies.tables"])
def test_lab_command_runs(module):
    res = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert f"python -m {module}" in res.stdout


@pytest.mark.parametrize("study", ["a", "b"])
def test_study_script_runs_the_lab_sweep(tmp_path, study):
    # A stand-in python records each call and answers the chunk count the scripts ask for.
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\necho 1000\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), TRAIN="t.h5", HELDOUT="h.h5", EPOCHS="3")
    res = subprocess.run(["bash", f"lab/studies/study_{study}.sh", str(tmp_path / "sw")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr
    sweeps = [ln for ln in calls.read_text().splitlines() if ln.startswith("-m ")]
    assert sweeps and all(ln.startswith(f"-m lab.sweep --sweep-dir {tmp_path / 'sw'} ")
                          and "--epochs 3" in ln and "--train t.h5" in ln for ln in sweeps)
