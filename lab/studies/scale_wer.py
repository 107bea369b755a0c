"""WER of sweep cells over folds and seeds, each configuration against a reference, paired.

Reads the ``results.jsonl`` of one or more ``lab.sweep --wer`` directories (one a fold:
``ROOT/foldA``, ``ROOT/foldC``, ...; issue 46's studies), takes each cell's last row, names
its configuration by what decides it (algorithm, learners, global batch, optimizer, beta1,
tau, moments, super-learner size and the flags passed through, less the data and the
bookkeeping), and prints one row a configuration: its WER per (fold, seed), the mean, and the
mean of its paired differences to ``--reference`` over the (fold, seed) pairs both have (the
folds differ by up to 10 points, so only paired differences say much), with the run's steps
and held-out frame accuracy. ``--json`` writes the rows and the summary; ``--losses`` adds
a second table of how each configuration trained (held-out loss after the first epoch, its
best, and the last logged training loss, means over the runs), which tells a model that
under-trains from one that over-fits. Usage::

    python -m lab.studies.scale_wer runs/bmuf-adam16 --reference single
    python -m lab.studies.scale_wer runs/bmuf-adam16/foldA runs/bmuf-adam16/foldC --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.sweep.results import latest_rows, read_jsonl
from lab.sweep.score import flag_value

SKIPPED_FLAGS = {"--train": 1, "--heldout": 1, "--keep-checkpoints": 1, "--log-every": 1}
"""Passthrough flags that do not decide a result (and the values they take)."""


def config_name(row: dict[str, Any]) -> str:
    """A short, stable name of what decides the cell's result (its seed and data left out)."""
    parts = [row["algo"], f"N{row['learners']}", f"B{row['global_batch']}", row["optimizer"]]
    for key, tag in (("beta1", "b1="), ("sync_period", "tau"), ("adam_moments", ""),
                     ("super_learner_size", "sl")):
        if row.get(key) is not None:
            parts.append(f"{tag}{row[key]}")
    extra = (row.get("extra") or "").split()
    i = 0
    while i < len(extra):
        if extra[i] in SKIPPED_FLAGS:
            i += 1 + SKIPPED_FLAGS[extra[i]]
            continue
        parts.append(extra[i].removeprefix("--"))
        i += 1
    return " ".join(parts)


def fold_of(row: dict[str, Any]) -> str:
    """The fold a cell ran on: the folder of its ``--train`` file (``spA``), else ``-``."""
    train = flag_value((row.get("extra") or "").split(), "--train")
    return Path(train).parent.name if train else "-"


def collect(dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """The last row of every scored cell under ``dirs`` (a sweep folder or a folder of them)."""
    rows = []
    for d in dirs:
        sweeps = [d] if (d / "results.jsonl").exists() else sorted(
            p.parent for p in d.glob("*/results.jsonl"))
        for sweep in sweeps:
            rows += [r for r in latest_rows(sweep).values() if r.get("status") in ("ok",
                                                                                    "diverged")]
    return rows


def summarise(rows: Sequence[dict[str, Any]], reference: str | None = None
              ) -> list[dict[str, Any]]:
    """One entry a configuration; ``reference``: a configuration name or a unique part of one.

    A diverged run counts as 100 % WER (it has no model worth decoding).
    """
    by: dict[str, dict[tuple[str, Any], dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(config_name(r), {})[(fold_of(r), r.get("seed"))] = r
    names = list(by)
    ref = None
    if reference is not None:
        hits = [n for n in names if n == reference] or [n for n in names if reference in n]
        ref = hits[0] if len(hits) == 1 else None

    def wer(r: dict[str, Any]) -> float | None:
        return 100.0 if r.get("status") == "diverged" else r.get("wer")

    out = []
    for name in names:
        runs = {k: wer(r) for k, r in sorted(by[name].items(), key=lambda kv: str(kv[0]))}
        done = [w for w in runs.values() if w is not None]
        entry: dict[str, Any] = {
            "config": name, "runs": {f"{f}/s{s}": w for (f, s), w in runs.items()},
            "mean": statistics.mean(done) if done else None,
            "steps": statistics.mean(r["steps"] for r in by[name].values() if r.get("steps")
                                     ) if any(r.get("steps") for r in by[name].values()) else None,
            "acc": statistics.mean(r["final_heldout_acc"] for r in by[name].values()
                                   if r.get("final_heldout_acc") is not None)
            if any(r.get("final_heldout_acc") is not None for r in by[name].values()) else None,
            "paired_delta": None, "pairs": 0}
        if ref is not None and name != ref:
            base = {k: wer(r) for k, r in by[ref].items()}
            diffs = [w - base[k] for k, w in runs.items()
                     if w is not None and base.get(k) is not None]
            if diffs:
                entry["paired_delta"], entry["pairs"] = statistics.mean(diffs), len(diffs)
        out.append(entry)
    return out


def last_train_loss(out_dir: str | None) -> float | None:
    """The loss of the last training line in a run's ``metrics.jsonl``, if it is there."""
    entries = read_jsonl(Path(out_dir) / "metrics.jsonl") if out_dir else []
    losses = [float(e["loss"]) for e in entries
              if e.get("kind") == "train" and e.get("loss") is not None]
    return losses[-1] if losses else None


def losses(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: mean held-out loss after epoch 1, mean best, mean last training loss.

    Diverged runs are left out (their losses say only that they diverged).
    """
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("heldout_loss_curve"):
            by.setdefault(config_name(r), []).append(r)

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.mean(known) if known else None

    return [{"config": name, "runs": len(runs),
             "first_epoch": mean([r["heldout_loss_curve"][0] for r in runs]),
             "best": mean([min(r["heldout_loss_curve"]) for r in runs]),
             "last_train": mean([last_train_loss(r.get("out_dir")) for r in runs])}
            for name, runs in by.items()]


def losses_table(entries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`losses`'s entries."""
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["| configuration | runs | held-out loss after epoch 1 | best held-out loss | "
             "last training loss |", "|---|---|---|---|---|"]
    lines += [f"| {e['config']} | {e['runs']} | {cell(e['first_epoch'])} | {cell(e['best'])} "
              f"| {cell(e['last_train'])} |" for e in entries]
    return "\n".join(lines)


def table(summary: Sequence[dict[str, Any]], reference: str | None) -> str:
    """A Markdown table of :func:`summarise`'s entries."""
    lines = ["| configuration | WER by fold/seed | mean WER | vs "
             f"{reference or 'reference'} (paired) | steps | frame acc. |",
             "|---|---|---|---|---|---|"]
    for e in summary:
        runs = " / ".join(f"{k} {'-' if w is None else f'{w:.1f}'}" for k, w in e["runs"].items())
        mean = "-" if e["mean"] is None else f"{e['mean']:.2f} %"
        delta = "-" if e["paired_delta"] is None else f"{e['paired_delta']:+.2f} ({e['pairs']})"
        steps = "-" if e["steps"] is None else f"{e['steps']:.0f}"
        acc = "-" if e["acc"] is None else f"{e['acc']:.3f}"
        lines.append(f"| {e['config']} | {runs} | {mean} | {delta} | {steps} | {acc} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; write the JSON where asked."""
    p = argparse.ArgumentParser(prog="python -m lab.studies.scale_wer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", type=Path, nargs="+", help="lab.sweep folders, or folders of them")
    p.add_argument("--reference", default=None,
                   help="the configuration the others are paired against (its name or a "
                        "unique part of it, e.g. 'N1 ')")
    p.add_argument("--json", type=Path, default=None, help="write rows and summary here")
    p.add_argument("--losses", action="store_true",
                   help="also the table of held-out and training losses per configuration")
    a = p.parse_args(argv)
    rows = collect(a.dirs)
    if not rows:
        print(f"lab.studies.scale_wer: no finished cells under {', '.join(map(str, a.dirs))}",
              file=sys.stderr)
        return 1
    summary = summarise(rows, a.reference)
    print(table(summary, a.reference))
    if a.losses:
        print("\n" + losses_table(losses(rows)))
    if a.json is not None:
        keep = ("id", "status", "algo", "learners", "global_batch", "batch_size", "optimizer",
                "beta1", "sync_period", "adam_moments", "super_learner_size", "seed", "epochs",
                "preset", "extra", "steps", "final_heldout_loss", "final_heldout_acc", "wer",
                "ser", "wall_s", "command")
        a.json.write_text(json.dumps({
            "rows": [{k: r.get(k) for k in keep} | {"config": config_name(r),
                                                      "fold": fold_of(r)} for r in rows],
            "reference": a.reference, "summary": summary, "losses": losses(rows)},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
