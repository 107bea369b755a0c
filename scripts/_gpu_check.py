"""What ``scripts/gpu_check.py`` decides without a GPU: budget, results, report.

Pure functions (no torch, no subprocess), so ``tests/lab/test_gpu_check.py`` checks them on
any machine:

- the **budget**: whether a check may still start, and the time limit of each command it runs
  (its own limit, cut to what is left of the budget);
- **statuses**: ``pass``, ``fail``, ``needs N GPUs`` (fine: the machine has fewer), ``skipped``
  (a test's own skip), ``not in this part`` (fine: the other part of the plan runs it, the
  report gives its command), ``over budget`` (not started: the budget ran out, which fails
  the run);
- the **parts**: the report path of each part and the command that runs the other one;
- the **settings** of a training check (batch, precision, TF32), from its ``config.json``;
- ``pytest``'s JUnit record as one report row per test;
- the **report**: a Markdown table and its JSON twin.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIPPED, OVER_BUDGET = "pass", "fail", "skipped", "over budget"
"""The statuses besides ``needs N GPUs`` and ``not in this part``."""
OTHER_PART = "not in this part"
"""A check of the plan's other part: not run by this command and no failure (the report
gives the command of its part)."""
NEEDS_GPUS_RE = re.compile(r"(\d+)\s+(?:or more\s+)?GPUs")
"""A skip reason that names a GPU count (``needs 2 GPUs``)."""
PER_TEST_MAX_S = 150.0
"""pytest-timeout's limit per GPU test when the budget leaves more: 2.5 x the slowest test on
one H100 (60 s, the throughput benchmark), so a hung test frees its xdist worker while the
run still has time to finish the others and write the record."""


@dataclass
class Check:
    """One row of the report."""

    name: str
    """What was checked."""
    status: str = SKIPPED
    """``pass``, ``fail``, ``needs N GPUs``, ``skipped``, ``not in this part`` or ``over
    budget``."""
    seconds: float = 0.0
    """Wall-clock time of the check."""
    detail: str = ""
    """One line: the figure, or why it failed."""
    lines: list[str] = field(default_factory=list)
    """Start-up lines, warnings and the tail of a failure's output."""
    key: str = ""
    """The plan's key (for ``--only``)."""
    batch: str = "-"
    """Per-rank batch of a training check (``-`` where none applies)."""
    precision: str = "-"
    """``--precision`` of a training check."""
    tf32: str = "-"
    """``on``, ``off`` or ``-``."""
    frames_per_s: float | None = None
    """Median frames/s of the steady ``metrics.jsonl`` windows (first window left out)."""


# ---------------------------------------------------------------------------- budget
BAD_OUTPUT = (
    ("contiguous chunk", "cuDNN warned: LSTM weights not in one contiguous chunk (copied)"),
    ("the LSTM runs in fp32 under",
     "the LSTM fell back to fp32 (cuDNN ran no half-precision LSTM): the run's bf16 / fp16 "
     "is not what it says"),
)
"""Lines of a training run that exits 0 which still fail its check: what the run then
measured is not what the check is for (a weight copy at every forward; an LSTM in fp32 under
a half-precision flag, hadpsgd.models.lstm's warning)."""


def bad_output(text: str) -> str | None:
    """Why a training run's output fails its check although it exited 0, or None.

    Args:
        text: The run's standard output and error.
    """
    for needle, why in BAD_OUTPUT:
        if needle in text:
            return why
    return None


def start_limit(elapsed: float, budget: float, limit: float, need: float) -> float | None:
    """The time limit a check starts with, or ``None`` when it must not start.

    Args:
        elapsed: Seconds since the checks began.
        budget: Seconds all checks may take.
        limit: The check's own limit (a hang ends there).
        need: Seconds the check takes when it passes (measured on one H100): starting with
            less left would only end in a timeout.

    Returns:
        ``min(limit, budget - elapsed)``, or ``None`` when less than ``need`` is left.
    """
    left = budget - elapsed
    if left < need or left <= 0:
        return None
    return min(limit, left)


def launch_limit(now: float, deadline: float, limit: float) -> tuple[float, bool]:
    """One command's time limit inside a check: its own, or what is left until ``deadline``.

    Returns:
        The seconds, and whether the deadline (the budget) is what set them, so that a
        timeout there is reported as "cut at the budget" and not as a hang.
    """
    left = max(1.0, deadline - now)
    return (left, True) if left < limit else (limit, False)


def pytest_limits(limit: float) -> tuple[float, float]:
    """The limit of the whole ``pytest tests/gpu`` run and of each test in it.

    Each test ends before the run does (pytest-timeout then names it and the run goes on to
    write its record), so one hung test cannot cost the report of every other.

    Returns:
        ``(run seconds, per-test seconds)``.
    """
    per_test = max(10.0, min(PER_TEST_MAX_S, limit - 20.0))
    return limit, per_test


# ---------------------------------------------------------------------------- statuses
def skip_status(reason: str) -> str:
    """The status of a skipped test: ``needs N GPUs`` when that is the reason, else skipped."""
    m = NEEDS_GPUS_RE.search(reason)
    return f"needs {m.group(1)} GPUs" if m else SKIPPED


def failed(check: Check) -> bool:
    """Whether ``check`` fails the run: a failure, or a check the budget left out."""
    return check.status in (FAIL, OVER_BUDGET)


def exit_status(checks: Sequence[Check]) -> int:
    """0 when no check failed and the budget left none out; 1 otherwise."""
    return 1 if any(failed(c) for c in checks) else 0


def counts_line(checks: Sequence[Check]) -> str:
    """``**2 failed**, 30 passed, 4 need more GPUs (fine here), 1 over budget (fails)...``."""
    n_fail = sum(c.status == FAIL for c in checks)
    n_over = sum(c.status == OVER_BUDGET for c in checks)
    n_need = sum(c.status.startswith("needs") for c in checks)
    n_other = sum(c.status == OTHER_PART for c in checks)
    return (f"**{n_fail} failed**, {sum(c.status == PASS for c in checks)} passed, "
            f"{n_need} need more GPUs than this machine has (not a failure), "
            f"{n_over} not run for lack of budget (a failure), "
            f"{sum(c.status == SKIPPED for c in checks)} skipped by the test itself"
            + (f", {n_other} in the other part of the plan (not a failure)" if n_other else ""))


def not_in_part(name: str, key: str, part: int, command: str) -> Check:
    """The row of a check that belongs to plan part ``part``, which this command does not run.

    Args:
        name: The check's row name.
        key: Its plan key.
        part: The part it belongs to.
        command: The command that runs that part.
    """
    return Check(name, OTHER_PART, key=key, detail=f"part {part}: {command}")


def rerun_hint(checks: Sequence[Check], report: str, budget: float) -> str | None:
    """The command that runs the checks the budget left out, or ``None`` if there are none."""
    keys = list(dict.fromkeys(c.key for c in checks if c.status == OVER_BUDGET and c.key))
    if not keys:
        return None
    return (f"bash scripts/gpu_check.sh {report} --only {','.join(keys)} "
            f"--budget {budget:.0f}")


# ---------------------------------------------------------------------------- parts
def part_report(report: str, part: str) -> str:
    """The report path of plan part ``part`` beside ``report`` (the report of any part).

    Part 1 keeps the name (``gpu-check-report.md``); parts 2 and 3 and ``all`` add
    ``-part2``, ``-part3`` and ``-all`` to it, so that running another part does not
    overwrite this part's report.
    """
    head, sep, name = report.rpartition("/")
    stem, dot, ext = name.rpartition(".") if "." in name else (name, "", "")
    stem = re.sub(r"-(part[23]|all)$", "", stem)
    suffix = "" if part == "1" else f"-part{part}" if part.isdigit() else f"-{part}"
    return f"{head}{sep}{stem}{suffix}{dot}{ext}"


def part_command(report: str, part: str) -> str:
    """The command that runs plan part ``part``, its report beside ``report``."""
    other = part_report(report, part)
    if other == report:  # a part-2 report named without its suffix: keep it
        head, sep, name = report.rpartition("/")
        stem, dot, ext = name.rpartition(".") if "." in name else (name, "", "")
        other = f"{head}{sep}{stem}-part{part}{dot}{ext}"
    return f"bash scripts/gpu_check.sh {other} --part {part}"


# ---------------------------------------------------------------------------- settings
def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value after ``flag`` in ``args`` (``--flag v`` or ``--flag=v``), else ``None``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def run_settings(config: Mapping[str, Any] | None, args: Sequence[str]) -> tuple[str, str, str]:
    """Batch, precision and TF32 of a ``hadpsgd.run`` check.

    From the run's ``config.json`` where it was written (what the run really used, defaults
    included), else from the command line with hadpsgd's defaults (32, fp32, TF32 off).

    Returns:
        ``(batch, precision, "on" | "off")`` as strings for the report.
    """
    train = (config or {}).get("train") or {}
    if train:  # "precision" holds precision and tf32 (in "train" before it had its section)
        arith = (config or {}).get("precision") or train
        return (str(train.get("batch_size", "-")), str(arith.get("precision", "-")),
                "on" if arith.get("tf32") else "off")
    tf32 = "--tf32" in args and "--no-tf32" not in args
    return (flag_value(args, "--batch-size") or "32", flag_value(args, "--precision") or "fp32",
            "on" if tf32 else "off")


# ---------------------------------------------------------------------------- pytest
def junit_checks(xml_text: str) -> list[Check]:
    """One :class:`Check` per test case of a JUnit XML record (``pytest --junitxml``)."""
    out = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        name = f"tests/gpu {case.get('name')}"
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            check = Check(name, FAIL, detail=(bad.get("message") or "")[:200],
                          lines=text.splitlines()[-40:])
        elif skip is not None:
            why = skip.get("message") or ""
            check = Check(name, skip_status(why), detail=why[:200])
        else:
            check = Check(name, PASS)
        check.key = "pytest"
        check.seconds = round(float(case.get("time") or 0), 1)
        out.append(check)
    return out


# ---------------------------------------------------------------------------- report
def _cell(text: str) -> str:
    return text.replace("|", "/")


def markdown(checks: Sequence[Check], header: Sequence[str],
             hint: str | None = None, other: str | None = None) -> str:
    """The Markdown report: header, counts, one table row per check, then each one's lines.

    Args:
        checks: The rows.
        header: Lines above the counts (date, GPUs, versions, part, budget).
        hint: The command that runs what the budget left out, if anything.
        other: The command that runs the plan's other part, if this run was one part.
    """
    lines = ["# hadpsgd GPU check", "", *header, "", counts_line(checks), ""]
    if hint:
        lines += [f"Not run for lack of budget; run them with: `{hint}`", ""]
    if other:
        lines += [f"The other part of the plan: `{other}`", ""]
    lines += ["frames/s: median of the steady `metrics.jsonl` windows (the first window of a "
              "run or of a resumed run, its warm-up, left out); batch is per rank.", "",
              "| check | result | s | batch | precision | TF32 | frames/s | detail |",
              "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        fps = f"{c.frames_per_s:,.0f}" if c.frames_per_s is not None else "-"
        lines.append(f"| {_cell(c.name)} | {c.status} | {c.seconds:.0f} | {c.batch} | "
                     f"{c.precision} | {c.tf32} | {fps} | {_cell(c.detail)} |")
    for c in checks:
        if c.lines:
            lines += ["", f"## {c.name}", "", "```", *c.lines, "```"]
    return "\n".join(lines) + "\n"


__all__ = ["FAIL", "OTHER_PART", "OVER_BUDGET", "PASS", "SKIPPED", "Check", "counts_line",
           "exit_status", "failed", "flag_value", "junit_checks", "launch_limit", "markdown",
           "not_in_part", "part_command", "part_report", "pytest_limits", "rerun_hint",
           "run_settings", "skip_status", "start_limit"]
