"""Training throughput of hadpsgd SSGD against torch DDP and a plain loop: the entry point.

``python benchmarks/train_throughput.py`` and ``python -m benchmarks.train_throughput`` both run
:func:`benchmarks.training.throughput.main`; the options are documented there.
"""

import sys
from pathlib import Path

if not __package__:
    # Run as a script, this file's directory (benchmarks/) is on sys.path, not the repository
    # root that holds the benchmarks package: add the root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.training.throughput import main  # noqa: E402 - after the path set-up

if __name__ == "__main__":
    sys.exit(main())
