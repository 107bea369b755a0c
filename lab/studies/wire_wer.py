"""Bytes between nodes against word error rate, one point per configuration (issue 45).

Reads the rows a wire study recorded (``docs/data/wire-wer-espeak.json``: a configuration,
a seed (and a fold, where the set has folds), its WER and its inter-node bytes per trained
frame), prints the table of means and
draws the curve: bytes a trained frame on a log axis, the mean WER over seeds with the
seeds' range as error bars, SSGD fp32 as the reference line. Usage::

    python -m lab.studies.wire_wer docs/data/wire-wer-espeak.json --png docs/img/wire-wer-espeak.png
    python -m lab.studies.wire_wer docs/data/gossip-wer-espeak.json --reference adpsgd-fp32
    python -m lab.studies.wire_wer docs/data/wire-wer-so762-w16.json --from-study \
        docs/data/speechocean-study/results.jsonl --workers 16 --configs ssgd bmuf ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def summarise(rows: Sequence[dict[str, Any]], reference: str = "ssgd") -> list[dict[str, Any]]:
    """One entry per configuration: its bytes a frame, ratios, WERs, mean, min and max.

    Bytes and the ratio to SSGD fp32 are means over the seeds (an asynchronous run's traffic
    varies with its timing); ``ref_ratio`` is ``reference``'s mean bytes over the entry's
    (None where the record has no such configuration).
    """
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["config"], []).append(row)
    out = []
    for config, runs in by.items():
        wers = [r["wer"] for r in sorted(runs, key=lambda r: (r["seed"], r.get("fold", "")))]
        out.append({"config": config,
                    "bytes_per_frame": statistics.mean(r["bytes_per_frame"] for r in runs),
                    "ratio": statistics.mean(r["ratio_to_ssgd_fp32"] for r in runs),
                    "wers": wers, "mean": statistics.mean(wers), "low": min(wers),
                    "high": max(wers)})
    ref = next((e for e in out if e["config"] == reference), None)
    for e in out:
        e["ref_ratio"] = ref["bytes_per_frame"] / e["bytes_per_frame"] if ref else None
    return sorted(out, key=lambda e: -e["bytes_per_frame"])


def table(summary: Sequence[dict[str, Any]], reference: str = "ssgd",
          column: str = "bytes a trained frame") -> str:
    """A markdown table of :func:`summarise`'s entries (a column against ``reference``)."""
    extra = reference != "ssgd" and any(e["ref_ratio"] for e in summary)
    head = f"| run | {column} | vs SSGD fp32 |"
    rows = [head + (f" vs {reference} |" if extra else "") + " WER by seed | mean |",
            "|---|---|---|" + ("---|" if extra else "") + "---|---|"]
    for e in summary:
        ref = f" {e['ref_ratio']:,.1f}x |" if extra else ""
        rows.append(f"| {e['config']} | {e['bytes_per_frame']:,.3g} | {e['ratio']:,.1f}x |{ref} "
                    f"{' / '.join(f'{w:.2f}' for w in e['wers'])} | {e['mean']:.2f} % |")
    return "\n".join(rows)


X_LABEL = "inter-node bytes a trained frame (one rank, log)"
"""The curve's x axis where the record names none (its ``x_label``)."""


def study_rows(results: Sequence[dict[str, Any]], workers: int,
               configs: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a wire record from a speech study's ``results.jsonl`` (its finished runs).

    A study's run records rank 0's inter-node bytes over the whole run, not its frames; every
    configuration of one worker count trains the same frames (the same data, epochs and
    batch), so those bytes stand in for bytes a frame (the record says so in its
    ``x_label``) and the ratio is against SSGD's bytes in the same record.

    Args:
        results: The study's records (one per run).
        workers: Keep the runs of this many workers.
        configs: Keep these configurations (an SSGD one named ``ssgd`` among them).
    """
    runs = [r for r in results if r.get("workers") == workers and r.get("status") == "ok"
            and r.get("config") in configs and r.get("wer") is not None]
    ssgd = [r["internode_bytes"] for r in runs if r["config"] == "ssgd"]
    if not ssgd:
        raise SystemExit(f"no finished ssgd run at {workers} workers: nothing to compare with")
    reference = statistics.mean(ssgd)
    return [{"config": r["config"], "seed": r["seed"], "wer": round(r["wer"], 2),
             "bytes_per_frame": r["internode_bytes"],
             "ratio_to_ssgd_fp32": reference / r["internode_bytes"]} for r in runs]


def plot(summary: Sequence[dict[str, Any]], png: Path, reference: str = "ssgd",
         x_label: str = X_LABEL) -> None:
    """The curve as a PNG (matplotlib, without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in summary:
        ax.errorbar(e["bytes_per_frame"], e["mean"],
                    yerr=[[e["mean"] - e["low"]], [e["high"] - e["mean"]]], fmt="o", capsize=3)
        ax.annotate(e["config"], (e["bytes_per_frame"], e["mean"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ref = next((e for e in summary if e["config"] == reference), None)
    if ref is not None:
        ax.axhline(ref["mean"], color="grey", linestyle="--", linewidth=1,
                   label=f"{reference} (mean)")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel("WER on unseen voices (%), mean and range of seeds")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; draw the PNG where asked."""
    parser = argparse.ArgumentParser(prog="python -m lab.studies.wire_wer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="the study's JSON (its 'rows')")
    parser.add_argument("--png", type=Path, default=None, help="draw the curve here")
    parser.add_argument("--min-runs", type=int, default=1,
                        help="draw only the configurations with at least this many runs (the "
                             "table keeps every one; default 1)")
    parser.add_argument("--reference", default="ssgd",
                        help="the configuration the bytes are also compared with, and the "
                             "figure's reference line (default ssgd)")
    parser.add_argument("--from-study", type=Path, default=None, metavar="RESULTS",
                        help="make RECORD from a speech study's results.jsonl first (its "
                             "finished runs of --workers and --configs), then read it")
    parser.add_argument("--workers", type=int, default=16, help="with --from-study")
    parser.add_argument("--configs", nargs="+", default=[], help="with --from-study")
    opts = parser.parse_args(argv)
    if opts.from_study is not None:
        results = [json.loads(line) for line in opts.from_study.read_text().splitlines()
                   if line.strip()]
        record = {"set": f"{opts.from_study} at {opts.workers} workers",
                  "column": "bytes a rank over the run",
                  "x_label": "inter-node bytes one rank sent over the run (log)",
                  "rows": study_rows(results, opts.workers, opts.configs)}
        opts.record.write_text(json.dumps(record, indent=1) + "\n")
    record = json.loads(opts.record.read_text())
    summary = summarise(record["rows"], opts.reference)
    print(table(summary, opts.reference, record.get("column", "bytes a trained frame")))
    if opts.png is not None:
        plot([e for e in summary if len(e["wers"]) >= opts.min_runs], opts.png, opts.reference,
             record.get("x_label", X_LABEL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
