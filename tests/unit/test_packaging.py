"""Packaging: the license, the console scripts, and the launcher's argument split."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_string_with_its_file():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_console_scripts_exist_and_run_aborts_like_the_module():
    scripts = _pyproject()["project"]["scripts"]
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
    # hadpsgd-run goes through the wrapper that aborts the whole job on an escaped error.
    assert scripts["hadpsgd-run"] == "hadpsgd.run:script_main"


@pytest.mark.parametrize("argv", [
    ["-n", "2", "--dry-run", "--algo", "bmuf", "--epochs", "1"],
    ["-n", "2", "--dry-run", "--", "--algo", "bmuf", "--epochs", "1"],
    ["--algo", "bmuf", "-n", "2", "--epochs", "1", "--dry-run"],
])
def test_launcher_forwards_the_rest_with_or_without_separator(argv, capsys):
    from hadpsgd.launch.__main__ import main

    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert " -np 2 " in line
    assert line.endswith("-m hadpsgd.run --algo bmuf --epochs 1")
