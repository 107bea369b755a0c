"""The import rules of docs/design.md: each layer imports only the layers below it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hadpsgd"

# layer -> the hadpsgd layers it may import (docs/design.md, "Layers and what each may import")
ALLOWED = {
    "exit_codes": set(),
    "env": set(),
    "cli": set(),
    "models": set(),
    "precision": set(),
    "launch": {"env", "exit_codes"},
    "comm": {"env", "exit_codes"},
    "data": {"env"},
    "faults": {"cli", "env"},
    # No test hooks in the algorithms: HADPSGD_FAULT reaches the gossip thread through the
    # world it is given (comm/faulty.py), not through a hook in its code.
    "algorithms": {"cli", "comm", "precision"},
    "config_file": {"cli"},
    "config": {"cli", "config_file", "env", "models", "algorithms", "precision"},
    # The loop takes built parts and knows no flags: neither cli nor config. It drives the
    # algorithm through the public API, as a user's loop does.
    "train": {"exit_codes", "env", "models", "comm", "data", "faults", "algorithms",
              "precision", "api"},
    # The public API (hadpsgd.init, hadpsgd.Distributed): built parts a user's own loop
    # drives; it knows no flags of the run (no config) and no BLSTM (no models).
    "api": {"exit_codes", "cli", "comm", "data", "algorithms", "precision"},
    "assembly": {"exit_codes", "env", "cli", "models", "comm", "data", "faults", "algorithms",
                 "config", "train", "precision", "api"},
    # Decoding reads log-likelihood matrices: no torch, no training.
    "decode": {"exit_codes"},
    "run": {"exit_codes", "env", "cli", "models", "comm", "data", "faults", "algorithms",
            "config", "train", "assembly", "precision", "api"},
    # Decoding's forward pass: a top layer beside run (a checkpoint, features, ranks, output).
    "forward": {"exit_codes", "models", "data", "comm", "train", "precision"},
    # Export: forward's model, averaging and scores, written as TorchScript or ONNX.
    "export": {"exit_codes", "models", "data", "comm", "train", "precision", "forward"},
    # A run's curves from its metrics.jsonl: a top layer beside run, no MPI, no training.
    "plot": {"exit_codes", "train"},
}


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _imports(path: Path) -> set[str]:
    """The hadpsgd layers a module imports (at any depth, TYPE_CHECKING included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "hadpsgd":
                continue
            out.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names
                       if a.name.startswith("hadpsgd."))
    return out


def test_every_module_belongs_to_a_layer():
    layers = {_layer(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
              or p.parent != PACKAGE}
    assert layers <= set(ALLOWED), sorted(layers - set(ALLOWED))


def test_layers_import_only_downwards():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue
        layer = _layer(path)
        for target in _imports(path) - {layer}:
            if target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(PACKAGE.parent)} ({layer}) imports {target}")
    assert not bad, "\n".join(bad)


def test_no_circle_between_modules():
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        mod = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mod = mod.removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("hadpsgd"):
                deps.add(node.module)
        graph[mod] = deps
    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        for d in graph.get(m, ()):
            # a package's __init__ re-exporting its own modules is not a circle
            if d == m or d.startswith(m + ".") or m.startswith(d + "."):
                continue
            if seen.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack, m, d]))
            if d not in seen:
                visit(d, [*stack, m])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [])
