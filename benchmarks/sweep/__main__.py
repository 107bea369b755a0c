"""Forwards to ``python -m lab.sweep``: see :mod:`lab.sweep.cli` for the options."""

import sys

from lab.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
