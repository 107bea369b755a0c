"""The alpha-beta speedup projection: ``python -m benchmarks.project``.

See :mod:`benchmarks.projection.project` for the options and :mod:`benchmarks.projection` for
the cost model and its calibration.
"""

import sys

from benchmarks.projection.project import main

if __name__ == "__main__":
    sys.exit(main())
