"""What ran, where and with what: the ``provenance`` list of a run's ``config.json``.

Each start of a run directory (the first and every resume) appends one entry: the time, the
command line, the package versions and MPI library, the git commit of the code when it is a
checkout, and the hosts with their rank counts. The configuration at the top of the file is
the latest start's; the entries before it stay.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

from hadpsgd.comm import Topology, mpi_library_version

PACKAGES = ("hadpsgd", "torch", "numpy", "h5py", "mpi4py")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the hadpsgd source tree, when it is a git checkout (else None)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True, timeout=5,
                           check=False)
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def entry(topo: Topology, resume: str | None) -> dict[str, Any]:
    """This start's provenance (the hosts are those the topology gathered at start-up)."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(sys.argv),
        "resume": resume,
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in PACKAGES},
        "mpi_library": mpi_library_version(),
        "git_commit": git_commit(),
        "hosts": dict(Counter(topo.hosts)),
        "world_size": topo.size,
    }


def _short(value: Any) -> str:
    """A commit as 12 hex digits with its ``+dirty`` mark; anything else up to 60 characters."""
    text = str(value)
    head, dirty, _ = text.partition("+dirty")
    if dirty and len(head) == 40:
        return head[:12] + dirty
    return head[:12] if len(text) == 40 else text[:60]


def software_changes(before: Any, start: dict[str, Any]) -> list[str]:
    """What software differs from the run's previous start, in words (empty: the same).

    A resume under another torch, NumPy or hadpsgd (or another commit, or MPI library) goes
    on, but its steps may differ from the uninterrupted run's in the last bits, so it is said.
    """
    if not isinstance(before, dict):
        return []
    said = []
    old_versions, versions = before.get("versions"), start.get("versions")
    if isinstance(old_versions, dict) and isinstance(versions, dict):
        for name, now in versions.items():
            old = old_versions.get(name)
            if old is not None and now is not None and old != now:
                said.append(f"{name} {old} -> {now}")
    for key in ("git_commit", "mpi_library", "python"):
        old, now = before.get(key), start.get(key)
        if old is not None and now is not None and old != now:
            said.append(f"{key.replace('_', ' ')} {_short(old)} -> {_short(now)}")
    return said


def write_config(path: Path, resolved: dict[str, Any], start: dict[str, Any]) -> list[str]:
    """Write ``config.json``: the resolved configuration, earlier starts' entries and ours.

    Returns:
        :func:`software_changes` since the previous start recorded there.
    """
    earlier: list[Any] = []
    if path.exists():
        try:
            earlier = list(json.loads(path.read_text()).get("provenance", []))
        except (OSError, ValueError, AttributeError, TypeError):
            earlier = []  # unreadable: start the record again rather than fail the run
    out = {**resolved, "provenance": [*earlier, start]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)
    return software_changes(earlier[-1] if earlier else None, start)
