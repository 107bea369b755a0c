"""``python -m hadpsgd.comm``: the machine check (:mod:`hadpsgd.comm.check`)."""

import sys

from hadpsgd.comm.check import main

sys.exit(main())
