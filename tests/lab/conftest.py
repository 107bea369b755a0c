"""The lab's and the benchmarks' own tests (``lab/``, ``benchmarks/``): marked ``lab`` and
run apart from the product's suite (``bash scripts/test.sh tests/lab``; CI runs them after
it, beside the MPICH subset). Their hang guards and deadlines allow minutes where a job takes
seconds here: a loaded or slower machine must not fail them. Their multi-rank tests are
marked ``mpi`` as well."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``lab``."""
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.lab)
