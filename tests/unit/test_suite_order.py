"""The suite's own order (tests/conftest.py): the slow files first, every test still run."""

from __future__ import annotations

from types import SimpleNamespace

from tests._mpi import ROOT
from tests.conftest import SLOW_FILES, pytest_collection_modifyitems


def test_every_slow_file_listed_exists():
    """A file renamed or removed would quietly lose its place at the front."""
    missing = [name for name in SLOW_FILES if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py SLOW_FILES names files that are gone: {missing}"
    assert len(set(SLOW_FILES)) == len(SLOW_FILES)


def test_slow_files_go_first_and_the_rest_keep_their_order():
    ids = ["tests/unit/test_a.py::x", f"{SLOW_FILES[1]}::y", "tests/unit/test_b.py::z",
           f"{SLOW_FILES[0]}::v", f"{SLOW_FILES[1]}::w", "tests/unit/test_a.py::u"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [ids[3], ids[1], ids[4], ids[0], ids[2], ids[5]]
