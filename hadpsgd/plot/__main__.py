"""``python -m hadpsgd.plot RUN_DIR [RUN_DIR ...] [--out FILE.png]``: draw, print the path.

Exit status 0, or 2 (one line naming the problem and the fix) for a directory that is no
run, a run without records yet, a damaged ``metrics.jsonl`` or a missing matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hadpsgd.exit_codes import EXIT_OK, EXIT_USER_ERROR
from hadpsgd.plot import COMPARE_FILE, PLOT_FILE, PlotUnavailable, plot_run, plot_runs


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m hadpsgd.plot", allow_abbrev=False,
        description="Training loss, held-out loss and held-out frame accuracy against step, "
                    "from a run's metrics.jsonl; resumes and survived failures are marked. "
                    "Several runs: their held-out loss by step, against the bytes sent "
                    "between nodes, and those bytes against time, in one figure.")
    parser.add_argument("run_dir", type=Path, nargs="+",
                        help="the run's directory (its --out-dir, or an API run's run_dir); "
                             "several to compare them")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the PNG to write (default RUN_DIR/{PLOT_FILE}; for several "
                             f"runs ./{COMPARE_FILE})")
    args = parser.parse_args(argv)
    try:
        if len(args.run_dir) == 1:
            path = plot_run(args.run_dir[0], args.out)
        else:
            path = plot_runs(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, PlotUnavailable) as err:
        print(f"hadpsgd.plot: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as err:  # the figure could not be written
        default = args.run_dir[0] / PLOT_FILE if len(args.run_dir) == 1 else COMPARE_FILE
        print(f"hadpsgd.plot: error: cannot write {args.out or default} "
              f"({err.strerror or err}); choose another --out", file=sys.stderr)
        return EXIT_USER_ERROR
    print(path)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
