"""Bytes between nodes against word error rate, one point per configuration (issue 45).

Reads the rows a wire study recorded (``docs/data/wire-wer-espeak.json``: a configuration,
a seed (and a fold, where the set has folds), its WER and its inter-node bytes per trained
frame), prints the table of means and
draws the curve: bytes a trained frame on a log axis, the mean WER over seeds with the
seeds' range as error bars, SSGD fp32 as the reference line. Usage::

    python -m lab.studies.wire_wer docs/data/wire-wer-espeak.json --png docs/img/wire-wer-espeak.png
    python -m lab.studies.wire_wer docs/data/gossip-wer-espeak.json --reference adpsgd-fp32
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


def table(summary: Sequence[dict[str, Any]], reference: str = "ssgd") -> str:
    """A markdown table of :func:`summarise`'s entries (a column against ``reference``)."""
    extra = reference != "ssgd" and any(e["ref_ratio"] for e in summary)
    head = "| run | bytes a trained frame | vs SSGD fp32 |"
    rows = [head + (f" vs {reference} |" if extra else "") + " WER by seed | mean |",
            "|---|---|---|" + ("---|" if extra else "") + "---|---|"]
    for e in summary:
        ref = f" {e['ref_ratio']:,.1f}x |" if extra else ""
        rows.append(f"| {e['config']} | {e['bytes_per_frame']:,.3g} | {e['ratio']:,.1f}x |{ref} "
                    f"{' / '.join(f'{w:.2f}' for w in e['wers'])} | {e['mean']:.2f} % |")
    return "\n".join(rows)


def plot(summary: Sequence[dict[str, Any]], png: Path, reference: str = "ssgd") -> None:
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
    ax.set_xlabel("inter-node bytes a trained frame (one rank, log)")
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
    opts = parser.parse_args(argv)
    summary = summarise(json.loads(opts.record.read_text())["rows"], opts.reference)
    print(table(summary, opts.reference))
    if opts.png is not None:
        plot([e for e in summary if len(e["wers"]) >= opts.min_runs], opts.png, opts.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
