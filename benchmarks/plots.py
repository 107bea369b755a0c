"""Forwards to ``python -m lab.plots`` (the sweep's plots moved to :mod:`lab.sweep.plots`).

Kept so that ``python -m benchmarks.plots`` works as documented, with the same flags.
"""

import sys

from lab.sweep.plots import main

if __name__ == "__main__":
    sys.exit(main())
