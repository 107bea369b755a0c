"""Shared helpers of the resume tests: run, kill, resume, and compare states and chunk traces."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from hadpsgd.faults import parse
from tests._commands import run_command
from tests._mpi import MPIResult, assert_ok, run_mpi


def run_args(data: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    """``-m hadpsgd.run`` arguments for a small tiny-preset run into ``out``."""
    return ["-m", "hadpsgd.run", "--train", str(data[0]), "--heldout", str(data[1]),
            "--preset", "tiny", "--out-dir", str(out), "--no-progress", *extra]


def train(nprocs: int, data: tuple[Path, Path], out: Path, *extra: str,
          env: dict[str, str] | None = None, ok: bool = True) -> MPIResult:
    """Run training with the chunk trace going to ``out/trace``."""
    full_env = {"HADPSGD_TRACE_CHUNKS": str(out / "trace"), **(env or {})}
    # A run that ends normally, or with a fault the run itself takes (a non-finite gradient,
    # an overflow), goes to a warm world (tests/_commands.py); one whose fault ends a
    # process (kill, hang, stop, a signal, an exception) is launched.
    taken = all(f.kind in ("nan", "overflow") for f in parse(full_env.get("HADPSGD_FAULT", "")))
    runner = run_command if taken else run_mpi
    res = runner(nprocs, run_args(data, out, *extra), env=full_env)
    if ok:
        assert_ok(res)
    return res


def final_state(out: Path) -> dict:
    """The newest valid checkpoint of run directory ``out``, with every node's own part (a
    sharded checkpoint's ``node-NNNNN.pt`` files) as the list ``node_states``."""
    from hadpsgd.train import latest_checkpoint, load_checkpoint
    from hadpsgd.train.shards import PART_KEY, load_part

    path = latest_checkpoint(out / "checkpoints")
    state = load_checkpoint(path)
    if state.get(PART_KEY):
        state["node_states"] = [load_part(path, n) for n in range(state[PART_KEY])]
    return state


def kill_then_resume(nprocs: int, data: tuple[Path, Path], out: Path, *extra: str,
                     fault: str, env: dict[str, str] | None = None) -> MPIResult:
    """Run with ``fault`` injected (it must fail), then ``--resume auto`` to the end."""
    res = train(nprocs, data, out, *extra, env={"HADPSGD_FAULT": fault, **(env or {})},
                ok=False)
    assert res.returncode != 0, res.output[-3000:]
    assert "fault injection" in res.output
    return train(nprocs, data, out, *extra, "--resume", "auto", env=env)


def trace(out: Path) -> dict[int, dict[int, list[int]]]:
    """rank -> global step -> chunk indices; a step taken twice (redone after a resume) keeps
    its last record, which is the one that counts."""
    steps: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for path in sorted((out / "trace").glob("chunks-rank*.jsonl")):
        rank = int(path.stem.removeprefix("chunks-rank"))
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            steps[rank][rec["step"]] = rec["chunks"]
    return dict(steps)


def assert_equal(a: object, b: object, where: str) -> None:
    """Recursive bit-for-bit equality of nested checkpoint content."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_same_run(full: Path, resumed: Path) -> dict:
    """Final parameters, optimizer/algorithm state, position and chunk sequence all equal."""
    a, b = final_state(full), final_state(resumed)
    assert b["progress"] == a["progress"]
    for key in ("model", "eval_model", "algo", "node_states"):
        assert (key in a) == (key in b), key
        if key in a:
            assert_equal(a[key], b[key], key)
    ta, tb = trace(full), trace(resumed)
    assert ta.keys() == tb.keys() and ta
    for rank in ta:
        assert ta[rank] == tb[rank], f"rank {rank}: the chunk sequence differs"
    return a
