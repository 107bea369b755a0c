"""Forwards to ``python -m lab.project`` (the projection moved to :mod:`lab.projection`).

Kept so that ``python -m benchmarks.project`` works as documented, with the same flags.
"""

import sys

from lab.projection.project import main

if __name__ == "__main__":
    sys.exit(main())
