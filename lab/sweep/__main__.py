"""``python -m lab.sweep``: see :mod:`lab.sweep.cli`."""

import sys

from lab.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
