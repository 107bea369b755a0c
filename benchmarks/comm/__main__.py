"""``python -m benchmarks.comm``: the driver, or one rank (see :mod:`benchmarks.comm.cli`)."""

import sys

from benchmarks.comm.cli import main

if __name__ == "__main__":
    sys.exit(main())
