"""The test ranks' start-up: a stand-in for ``torch._dynamo`` where the test harness asks.

``tests/_mpi.py``'s :func:`job_env` puts this folder first on the ranks' ``PYTHONPATH`` and
sets ``HADPSGD_TEST_DYNAMO_STANDIN=1``; Python imports this file at every interpreter's start
(``site``), before the rank's own code. No other ``sitecustomize`` exists in the project's
environment; one found later on the path is run after this one, so none is shadowed.

Why: every ``torch.optim`` optimizer imports ``torch._dynamo`` when it is built
(``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``) and at its first step
(``torch._dynamo.graph_break()``), ~1.2 s of CPU a process on the 2-core CI machine, as much
as ``import torch`` itself. The multi-rank suite starts ~330 ranks that train a few steps each;
their processes' CPU (process accounting) was ~1,000 of the suite's ~1,370 CPU-s, and this
import about a third of it. Eagerly (nothing in a test compiles), both things torch asks of
dynamo there do nothing: ``disable(fn)`` hands back a wrapper that runs ``fn`` untraced, and
``graph_break()`` returns. The stand-in gives back ``fn`` itself and does nothing, so the
optimizer's arithmetic is torch's own, bit for bit (``tests/unit/test_dynamo_standin.py``).

Anything else asked of the module (an attribute the stand-in lacks, a submodule's import)
puts the real ``torch._dynamo`` in its place first and answers from it: a path that needs
dynamo gets it, at its usual cost. The main command's two-rank run in ``test_run_cli.py``
keeps the real import (``HADPSGD_TEST_DYNAMO_STANDIN=0``), as does a whole suite run with
``HADPSGD_TEST_REAL_DYNAMO=1``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

NAME = "torch._dynamo"


def _disable(fn: Callable | None = None, recursive: bool = True, **_: Any) -> Any:
    """``torch._dynamo.disable``: eagerly, the function itself (as a decorator, too)."""
    return fn if fn is not None else (lambda f: f)


def _graph_break(*_: Any, **__: Any) -> None:
    """``torch._dynamo.graph_break``: nothing to break outside a compiled frame."""


def _real() -> types.ModuleType:
    """Replace the stand-in by the real ``torch._dynamo`` (imported now) and return it."""
    _Finder.active = False
    current = sys.modules.get(NAME)
    if current is not None and not getattr(current, "STANDIN", False):
        return current  # the real one, perhaps still being imported
    sys.modules.pop(NAME, None)
    # torch's own attribute too: the real module's import reads torch._dynamo.<submodule>
    # before it is done, which must find the real module (torch's lazy __getattr__ gives
    # sys.modules' entry), not the stand-in.
    torch = sys.modules.get("torch")
    if torch is not None and getattr(getattr(torch, "_dynamo", None), "STANDIN", False):
        delattr(torch, "_dynamo")
    return importlib.import_module(NAME)


def _module_getattr(name: str) -> Any:
    # Dunders other than __path__ are Python's own questions (inspect, pickle, copy), which
    # a missing attribute answers; __path__ means a submodule is being imported.
    if name.startswith("__") and name != "__path__":
        raise AttributeError(name)
    return getattr(_real(), name)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.update(disable=_disable, graph_break=_graph_break,
                               __getattr__=_module_getattr, STANDIN=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Answers the import of ``torch._dynamo`` with the stand-in while ``active``."""

    active = True

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != NAME or not _Finder.active:
            return None
        return importlib.util.spec_from_loader(NAME, _Loader())


def _run_next_sitecustomize() -> None:
    """Run a ``sitecustomize`` further down the path, which this file would otherwise hide."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("HADPSGD_TEST_DYNAMO_STANDIN") == "1" and NAME not in sys.modules:
    sys.meta_path.insert(0, _Finder())
_run_next_sitecustomize()
