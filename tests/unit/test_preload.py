"""The start-up's background import (hadpsgd.comm.preload)."""

from __future__ import annotations

import subprocess
import sys

from hadpsgd.comm.preload import MODULES, Preload


def test_the_thread_imports_and_join_waits_for_it():
    # A fresh interpreter: this one may have imported torch._dynamo already.
    code = ("import sys, torch\n"
            "from hadpsgd.comm.preload import Preload\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "p = Preload()\n"
            "p.join()\n"
            "assert 'torch._dynamo' in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    assert MODULES == ("torch._dynamo",)


def test_a_failing_import_is_left_to_the_caller():
    p = Preload(["hadpsgd_no_such_module"])
    p.join()  # no exception here: the caller's own import raises it where it belongs
    assert not p._thread.is_alive()
