"""What the benchmark drivers share: run a worker on N local MPI ranks, emit the record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hadpsgd.launch import launch_env, mpirun_command  # noqa: E402


def run_worker(worker: str, args: list[str], nprocs: int | None, timeout: float,
               env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``python worker args`` on ``nprocs`` ranks; return the JSON lines it printed.

    ``nprocs=None`` runs one plain process (no mpirun): the single-process baselines.

    Raises:
        SystemExit: If the job fails, with its command and output.
    """
    cmd = [sys.executable, worker, *args]
    if nprocs is not None:
        cmd = mpirun_command(nprocs, [], module="x")[:-3] + cmd  # the launcher and its flags
    full_env = launch_env(nprocs=nprocs or 1)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if out.returncode != 0:
        raise SystemExit(f"benchmark step failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    return [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]


def emit(record: dict[str, Any], path: Path | None) -> None:
    """Print the record as one JSON line, and write it to ``path`` when given."""
    print(json.dumps(record))
    if path:
        path.write_text(json.dumps(record, indent=2) + "\n")
