"""PNG plots of a sweep directory: ``python -m benchmarks.plots``.

See :mod:`benchmarks.sweep.plots` for the options.
"""

import sys

from benchmarks.sweep.plots import main

if __name__ == "__main__":
    sys.exit(main())
