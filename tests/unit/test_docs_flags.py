"""The docs' lists of ``python -m hadpsgd.run`` options held to its ``--help``.

The README's flag tables once said ``--wire fp32|bf16|int8`` where sign, int4 and topk
existed, and left out flags that did (issue 58). Reference: the parser itself
(:func:`hadpsgd.config.run_parser`, what ``--help`` prints). The option table of
docs/usage.md lists every flag; no table row of the README or docs/usage.md names a flag the
command does not have; a flag shown with its values (``--wire fp32|bf16``) lists only values
the parser takes, and in the option table all of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hadpsgd.config import run_parser

ROOT = Path(__file__).resolve().parents[2]
# A flag in backticks, with its values if shown: `--wire fp32\|bf16` (escaped in tables).
MENTION = re.compile(r"`(--[a-z0-9-]+)(?:/--no-[a-z0-9-]+)?((?: [a-z0-9]+(?:\\?\|[a-z0-9-]+)+)?)")


def _flags() -> dict[str, list[str] | None]:
    """Every option string of the run's parser -> its choices (as text), or None."""
    out: dict[str, list[str] | None] = {}
    for action in run_parser()._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                out[opt] = [str(c) for c in action.choices] if action.choices else None
    return out


def _table_rows(text: str, section: str | None = None) -> list[str]:
    if section is not None:
        text = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [line for line in text.splitlines() if line.startswith("|")]


def _mentions(rows: list[str]) -> list[tuple[str, list[str]]]:
    found = []
    for row in rows:
        for flag, values in MENTION.findall(row):
            shown = values.strip().replace("\\|", "|").split("|") if values.strip() else []
            found.append((flag, shown))
    return found


def _option_table() -> list[str]:
    usage = (ROOT / "docs" / "usage.md").read_text()
    rows = _table_rows(usage, "Running")
    assert rows and rows[0].startswith("| group | options |")
    return rows


def test_the_option_table_lists_every_flag_of_the_command() -> None:
    listed = {flag for flag, _ in _mentions(_option_table())}
    flags = _flags()
    no_forms = {f for f in flags if f.startswith("--no-") and f.replace("--no-", "--") in flags}
    assert set(flags) - no_forms - listed == set(), "flags of --help missing from docs/usage.md"


def test_the_option_table_shows_every_value_of_a_flag_it_gives_values_for() -> None:
    flags = _flags()
    for flag, shown in _mentions(_option_table()):
        if shown and flags.get(flag) is not None and flag != "--resume":
            assert sorted(shown) == sorted(flags[flag] or []), (flag, shown, flags[flag])


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_no_table_names_a_flag_or_value_the_command_lacks(doc: str) -> None:
    flags = _flags()
    rows = _table_rows((ROOT / doc).read_text())
    for flag, shown in _mentions(rows):
        assert flag in flags, f"{doc} names {flag}, which python -m hadpsgd.run lacks"
        choices = flags[flag]
        if shown and choices is not None:
            assert set(shown) <= set(choices), (doc, flag, shown, choices)


def test_the_table_reader_sees_values_and_no_forms() -> None:
    # The pattern itself, on the forms the tables use.
    rows = ["| x | `--wire fp32\\|bf16\\|int8`, `--nesterov/--no-nesterov`, `--lr` |"]
    assert _mentions(rows) == [("--wire", ["fp32", "bf16", "int8"]), ("--nesterov", []),
                               ("--lr", [])]
