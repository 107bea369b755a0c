"""Forwards to ``python -m lab.studies.tables`` (the study tables moved to :mod:`lab.studies`).

Kept so that ``python -m benchmarks.studies.tables`` works as documented, with the same flags.
"""

import sys

from lab.studies.tables import main

if __name__ == "__main__":
    sys.exit(main())
