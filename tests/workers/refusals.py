"""Worker: several refused starts of ``python -m hadpsgd.run`` in one process (one launch).

``REFUSAL_CASES`` holds ``{name: argv}``. Each case runs ``hadpsgd.run.main(argv)`` with its
standard output and error captured, as the command's own process would say them; rank 0
prints one ``RESULTS`` line: per case the exit code ``main`` returned and what it printed.
Only for starts refused before training (a user's error, exit 2): a refusal leaves no state
behind that the next case could see (no run directory, no trainer), so the cases are
independent.
"""

import contextlib
import io
import json
import os

from hadpsgd import run

results = {}
for name, argv in json.loads(os.environ["REFUSAL_CASES"]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run.main(argv)
    results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print("RESULTS " + json.dumps(results), flush=True)
