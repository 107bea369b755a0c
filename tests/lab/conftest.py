"""The lab's and the benchmarks' own tests (``lab/``, ``benchmarks/``): marked ``lab`` and
run apart from the product's suite (``bash scripts/test.sh tests/lab``; CI runs them after
it, beside the MPICH subset). Their hang guards and deadlines allow minutes where a job takes
seconds here: a loaded or slower machine must not fail them. Their multi-rank tests are
marked ``mpi`` as well."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests._mpi import ranks_python


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``lab``."""
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.lab)


@pytest.fixture(autouse=True, scope="session")
def _ranks_import_the_dynamo_standin() -> Iterator[None]:
    """Every process a lab test starts (a benchmark's driver, its mpirun, their ranks) starts
    as the suite's ranks do (``tests/_mpi.py``'s ``ranks_python``): the lab's tests launch
    through the benchmarks' own code, which passes this process's environment on."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ranks_python(os.environ.get("PYTHONPATH", "")).items():
            patch.setenv(name, value)
        yield
