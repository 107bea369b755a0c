"""Round 3 of the elastic soak (issue 55 item 9): a user's script and an extended BMUF run.

Two kinds of round beside :mod:`soak_elastic`'s own (which also draws every wire, and
freezes learners in compressed block syncs):

- ``script``: the launcher's script mode (``python -m hadpsgd.launch -n N script.py``) runs
  :data:`SCRIPT` (a small model under ``hadpsgd.Distributed`` with SSGD, BMUF or ADPSGD, its
  own loop) in which one rank, at one step, does one of :data:`SCRIPT_CASES`: a deadlock in
  its own code, ``sys.exit(7)``, ``sys.exit(0)``, an exception, or nothing. Each has one
  right ending (:func:`check_script`): the exit code, and a line naming that rank.
- ``extend``: BMUF run for a first part (an epoch, or ``--max-steps`` mid-block), then
  extended with ``--resume auto --epochs 2``, against the uninterrupted two-epoch run: every
  tensor of the final checkpoints equal (:func:`compare_final`).
"""

from __future__ import annotations

import re
from pathlib import Path

SCRIPT = '''\
"""The soak's user script: {algo}, rank {rank} does {case!r} at step {step}."""
import sys
import threading

import torch

import hadpsgd

topo = hadpsgd.init()
torch.manual_seed(topo.rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dist = hadpsgd.Distributed(model, optimizer, "{algo}", topology=topo{options})
for step in range(1, {steps} + 1):
    if topo.rank == {rank} and step == {step}:
        case = "{case}"
        if case == "deadlock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
        elif case == "exit7":
            sys.exit(7)
        elif case == "exit0":
            sys.exit(0)
        elif case == "raise":
            raise RuntimeError("the soak's own error in rank {rank}")
    x = torch.randn(16, 8)
    loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
    optimizer.zero_grad()
    loss.backward()
    dist.step(loss)
dist.close()
print(f"rank {{topo.rank}}: done", flush=True)
'''
SCRIPT_CASES: dict[str, int] = {"deadlock": 3, "exit7": 7, "exit0": 0, "raise": 1, "ok": 0}
"""What the drawn rank does, and the job's one right exit code for it."""
SCRIPT_ALGOS: dict[str, str] = {"ssgd": "", "bmuf": ", sync_period=4", "adpsgd": ""}
STEPS = 40


def write_script(out: Path, algo: str, rank: int, case: str, step: int) -> Path:
    """The round's script, in its directory."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "script.py"
    path.write_text(SCRIPT.format(algo=algo, rank=rank, case=case, step=step, steps=STEPS,
                                  options=SCRIPT_ALGOS[algo]))
    return path


def check_script(case: str, rank: int, code: int | None, output: str) -> tuple[str | None,
                                                                              str | None]:
    """(what kind of problem, the problem) of a script round's job, or (None, None)."""
    tail = output[-1500:]
    if code is None:
        return "hang", f"still running at its limit: {tail}"
    want = SCRIPT_CASES[case]
    if code != want:
        return "exit", f"exit {code}, not {want}: {tail}"
    if case == "deadlock" and not re.search(
            rf"rank\(s\) {rank} never arrived \(rank {rank} answers: alive", output):
        return "message", f"no line naming the deadlocked rank {rank}: {tail}"
    if case.startswith("exit") and "dead or frozen" in output:
        return "message", f"rank {rank}'s exit blamed as dead or frozen: {tail}"
    if case == "exit7" and f"rank {rank}: the script exited with code 7" not in output:
        return "message", f"no line of rank {rank}'s exit code: {tail}"
    if case == "raise" and f"the soak's own error in rank {rank}" not in output:
        return "message", f"no traceback of rank {rank}'s error: {tail}"
    if case == "ok" and output.count(": done") == 0:
        return "message", f"no rank said done: {tail}"
    return None, None


def compare_final(full: Path, extended: Path) -> str | None:
    """Whether the final checkpoints of two runs hold equal tensors (None) or which differ."""
    import torch

    from hadpsgd.train import latest_checkpoint, load_checkpoint

    states = []
    for out in (full, extended):
        path = latest_checkpoint(out / "checkpoints")
        if path is None:
            return f"no checkpoint in {out}"
        states.append(load_checkpoint(path))
    differ = [f"{key}.{name}" for key in ("model", "eval_model")
              for name, value in states[0][key].items()
              if not torch.equal(value, states[1][key][name])]
    if states[0]["progress"]["global_step"] != states[1]["progress"]["global_step"]:
        differ.append("the step")
    return f"{len(differ)} tensors differ: {differ[:4]}" if differ else None


__all__ = ["SCRIPT_ALGOS", "SCRIPT_CASES", "STEPS", "check_script", "compare_final",
           "write_script"]
