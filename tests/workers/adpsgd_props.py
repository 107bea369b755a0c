"""Worker: ADPSGD invariants under mpirun (``tests/adpsgd_suite.py``'s cases).

Usage: ``adpsgd_props.py MODE OUTDIR``: MODE ``conserve``, ``consensus``, ``stall`` or
``dead`` (see the suite), settings from the ``ADPSGD_TEST_*`` variables; or MODE ``cases``:
the JSON list in ``ADPSGD_TEST_CASES`` (``{"name": ..., "mode": ..., "ADPSGD_TEST_STEPS":
...}``) one after another in one launch, each on a new ADPSGD over the same topology, each
writing ``OUTDIR/<name>/rank<r>.json`` (launches are most of the multi-rank suite's time).
"""

import json
import os
import sys
from pathlib import Path

from hadpsgd import comm
from tests.adpsgd_suite import run_case, run_cases

mode, out = sys.argv[1], Path(sys.argv[2])
topo = comm.init(device=os.environ.get("HADPSGD_TEST_DEVICE", "cpu"))
r = topo.rank
if mode == "cases":
    algo = run_cases(topo, json.loads(os.environ["ADPSGD_TEST_CASES"]), out)
else:
    algo = run_case(topo, mode, out, {})
topo.close()  # (a warm world runs this worker again in the same process)
