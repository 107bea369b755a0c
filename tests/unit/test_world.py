"""The face the algorithms, the loop and the API see (:class:`hadpsgd.comm.World`).

Two sides: ``Topology`` (the MPI world) has every member of the protocol with the same
parameters, and ``hadpsgd.algorithms``, ``hadpsgd.train`` and ``hadpsgd.api`` reach no member
of a world outside it (read from their source: any attribute of a variable that holds the
world), nor import ``Topology`` (but ``api/setup.py``, which makes it, and the API's exports).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path

from hadpsgd.comm import Topology, World

PACKAGE = Path(__file__).resolve().parents[2] / "hadpsgd"
USERS = ("algorithms", "train", "api")
# The names a world goes by in those packages (a parameter, an attribute, the API's global).
HOLDERS = {"topo", "topology", "_topology", "world"}


def _members(cls: type) -> set[str]:
    names = {n for n in vars(cls) if not n.startswith("_")}
    return names | set(getattr(cls, "__annotations__", {}))


def _sources() -> list[Path]:
    return [p for pkg in USERS for p in sorted((PACKAGE / pkg).rglob("*.py"))]


def _reached(tree: ast.AST) -> set[str]:
    """Attributes read of a world holder: ``topo.x``, ``self.topo.x``, ``self.topology.x``."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in HOLDERS:
            out.add(node.attr)
        elif isinstance(base, ast.Attribute) and base.attr in HOLDERS and isinstance(
                base.value, ast.Name) and base.value.id == "self":
            out.add(node.attr)
    return out


def face_gaps(cls: type, has: Callable[[str], bool]) -> list[str]:
    """What ``cls`` lacks of the face: a missing member (``has`` says which it has), or a
    method whose parameters differ. Shared with ``test_threads.py`` (the thread world)."""
    gaps = []
    for name in sorted(_members(World)):
        want = getattr(World, name, None)
        if not has(name):
            gaps.append(f"{name}: missing")
        elif inspect.isfunction(want) and (
                not inspect.isfunction(getattr(cls, name, None))
                or list(inspect.signature(want).parameters)
                != list(inspect.signature(getattr(cls, name)).parameters)):
            gaps.append(f"{name}: other parameters")
    return gaps


def test_topology_has_every_member_of_the_world_with_its_parameters() -> None:
    assert len(_members(World)) > 30
    fields = Topology.__dataclass_fields__
    assert face_gaps(Topology, lambda n: hasattr(Topology, n) or n in fields) == []


def test_the_algorithms_loop_and_api_reach_nothing_of_a_world_outside_the_face() -> None:
    face = _members(World)
    outside = {}
    for path in _sources():
        extra = _reached(ast.parse(path.read_text())) - face
        # A dict named ``world`` in train/plan.py (a checkpoint's record) is not a world.
        extra -= {"get"} if path.name == "plan.py" else set()
        if extra:
            outside[str(path.relative_to(PACKAGE))] = sorted(extra)
    assert not outside, f"members outside hadpsgd.comm.World: {outside}"


def test_only_the_api_setup_imports_the_mpi_world() -> None:
    importers = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Topology" for a in node.names):
                importers.append(str(path.relative_to(PACKAGE)))
    # api/setup.py makes it (hadpsgd.init); api/__init__.py re-exports the class to users.
    assert importers == ["api/__init__.py", "api/setup.py"], importers


def test_the_reader_sees_what_a_world_is_asked() -> None:
    tree = ast.parse("def f(topo):\n    topo.rank\n    self.topo.barrier()\n    other.size\n")
    assert _reached(tree) == {"rank", "barrier"}
