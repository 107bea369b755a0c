"""PNG plots of a sweep directory: ``python -m lab.plots``.

See :mod:`lab.sweep.plots` for the options.
"""

import sys

from lab.sweep.plots import main

if __name__ == "__main__":
    sys.exit(main())
