"""The alpha-beta speedup projection: ``python -m lab.project``.

See :mod:`lab.projection.project` for the options and :mod:`lab.projection` for
the cost model and its calibration.
"""

import sys

from lab.projection.project import main

if __name__ == "__main__":
    sys.exit(main())
