"""``python -m benchmarks.sweep``: see :mod:`benchmarks.sweep.cli`."""

import sys

from benchmarks.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
