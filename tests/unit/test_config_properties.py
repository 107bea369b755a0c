"""Property-based tests (hypothesis) of the run configuration a user can hand ``hadpsgd.run``.

The contract: any command line or ``--config`` file either yields a valid :class:`RunConfig`
or is refused with exit 2 and one message naming the flag or the key; never a traceback,
never another exception, never a bad value accepted silently. Driven in-process through
:func:`hadpsgd.config.parse_config`, the call ``hadpsgd.run.main`` makes first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hadpsgd.cli import MAX_INT, RankParser, add_arguments, option_name, to_dict
from hadpsgd.config import RunConfig, parse_config
from hadpsgd.config_file import SECTIONS

SOME = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

ALGOS = ("ssgd", "bmuf", "adpsgd")
_DEFAULTS = {algo: to_dict(parse_config(["--algo", algo])) for algo in ALGOS}
_KEYS = [(sec, name) for sec, body in _DEFAULTS["bmuf"].items() for name in body]
_OPTIONS = sorted({name for _, name in _KEYS})


def _types() -> dict[str, Any]:
    """Every option's name -> its annotated type (without ``| None``), and optional or not."""
    out: dict[str, Any] = {}
    run_hints = get_type_hints(RunConfig)
    for sec in dataclasses.fields(RunConfig):
        hints = get_type_hints(run_hints[sec.name])
        for f in dataclasses.fields(run_hints[sec.name]):
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            optional = type(None) in typing.get_args(hints[f.name])
            out[option_name(f)] = (args[0] if optional else hints[f.name], optional)
    return out


TYPES = _types()

_scalars = (st.none() | st.booleans() | st.integers() | st.floats()
            | st.sampled_from([10**30, -(10**30), 2**63, 10**400, 1e308, -1, 0, 1, 0.5, "",
                               "four", "1", "nan", "a\x00b", "x" * 300, "auto", "all"])
            | st.text(max_size=8))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6) | st.sampled_from(_OPTIONS), inner,
                                       max_size=3), max_leaves=10)


@pytest.fixture(autouse=True)
def _no_usage(monkeypatch):
    """Refusals without the usage text: formatting its 70 flags is most of a refusal's time."""
    monkeypatch.setattr(RankParser, "print_usage", lambda self, file=None: None)


def _parse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> RunConfig | str:
    """The configuration of ``argv``, or the one error message of its refusal (exit 2).

    Any other exception escapes and fails the test.
    """
    try:
        cfg = parse_config(argv)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2, (argv, exc.code, err)
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1, err
        return lines[0]
    capsys.readouterr()
    return cfg


def _assert_valid(cfg: RunConfig) -> None:
    """Every option holds a value of its type: finite floats, ints in range, no empty path."""
    flat = {name: value for body in to_dict(cfg).values() for name, value in body.items()}
    for name, value in flat.items():
        tp, optional = TYPES[name]
        if value is None:
            assert optional, name
            continue
        if tp is int:
            assert type(value) is int and 0 <= value <= MAX_INT, (name, value)
        elif tp is float:
            assert type(value) is float and math.isfinite(value), (name, value)
        elif tp is bool:
            assert type(value) is bool, (name, value)
        else:  # str or a Literal of strings
            assert isinstance(value, str) and value.strip() and "\0" not in value, (name, value)


def _write(tmp_path: Path, doc: Any) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _round_trips(cfg: RunConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An accepted configuration, written as config.json and given back, is the same one."""
    again = _parse(["--config", _write(tmp_path, to_dict(cfg))], capsys)
    assert isinstance(again, RunConfig), again
    assert to_dict(again) == to_dict(cfg)


_documents = (_json | st.dictionaries(
    st.sampled_from([*SECTIONS, "world", "provenance", "lr", "epochs", "train", "colour"]),
    st.dictionaries(st.sampled_from(_OPTIONS) | st.text(max_size=4), _json, max_size=3) | _json,
    max_size=4))


@SOME
@given(doc=_documents)
def test_any_json_document_is_a_valid_config_or_refused_naming_the_file(tmp_path, capsys, doc):
    path = _write(tmp_path, doc)
    got = _parse(["--config", path], capsys)
    if isinstance(got, str):
        # File errors name the file and the key; range errors name the option's flag.
        assert path in got or re.search(r"--[a-z]", got), got
        return
    _assert_valid(got)


@SOME
@given(algo=st.sampled_from(ALGOS), where=st.sampled_from(_KEYS), value=_json)
def test_one_value_replaced_is_refused_by_its_key_or_kept_valid(tmp_path, capsys, algo, where,
                                                                value):
    section, name = where
    doc = json.loads(json.dumps(_DEFAULTS[algo]))
    doc[section][name] = value
    doc["world"] = {"size": 4}
    got = _parse(["--config", _write(tmp_path, doc)], capsys)
    if isinstance(got, str):
        dashed = "--" + name.replace("_", "-")
        assert f"{section}.{name}" in got or dashed in got or "--" in got, got
        return
    _assert_valid(got)
    _round_trips(got, tmp_path, capsys)


def _flags() -> dict[str, Any]:
    """The generated parser's own flags -> the option's type (``bool`` for switches)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, RunConfig)
    flags: dict[str, Any] = {}
    for action in parser._actions:  # the generated option list, as --help shows it
        for text in action.option_strings:
            if text.startswith("--") and text != "--help":
                flags[text] = TYPES[action.dest][0] if action.dest in TYPES else str
    return {**flags, "--config": str}  # added by parse_config beside the generated ones


FLAGS = _flags()
_ADVERSARIAL = ["nan", "-inf", "inf", "1e400", "-1e400", "", "0x10", "1_000", " 3", "3 ",
                "１２", "٣", "x" * 5000, "9" * 5000, "-1", "0", "1", "2.5", "1e308", "-0",
                "+7", "1e3", "true", "None", "auto", "all", "lr,batch-size", "np", "--lr"]
_values = (st.sampled_from(_ADVERSARIAL) | st.integers().map(str)
           | st.floats().map(repr) | st.text(max_size=6))
_SWEPT = ["nan", "-inf", "1e400", "", "0x10", "1_000", " 3", "１２", "x" * 5000, "9" * 5000,
          "-1", "0", "2.5", "--"]
_ASCII_INT = re.compile(r"[+-]?[0-9]+")


def _check_command_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``argv`` is refused naming a flag it gives, or accepted as typed (no other number)."""
    got = _parse(argv, capsys)
    if isinstance(got, str):
        given_flags = {a.split("=")[0] for a in argv if a.startswith("--")}
        assert any(f in got for f in given_flags) or "unrecognized arguments" in got, got
        return
    _assert_valid(got)
    last: dict[str, str] = {}
    i = 0
    while i < len(argv):  # the value each flag ended with (the last one given wins)
        name, eq, value = argv[i].partition("=")
        if not eq and FLAGS.get(name, bool) is not bool:
            value, i = argv[i + 1], i + 1
        if FLAGS.get(name, bool) is not bool:
            last[name] = value
        i += 1
    for name, value in last.items():
        if FLAGS[name] is int:
            assert _ASCII_INT.fullmatch(value), (name, value)
        elif FLAGS[name] is float:
            assert value.isascii() and value == value.strip() and "_" not in value, (name, value)
            assert math.isfinite(float(value)), (name, value)


@SOME
@given(algo=st.sampled_from(ALGOS),
       pairs=st.lists(st.tuples(st.sampled_from(sorted(FLAGS)), _values, st.booleans()),
                      min_size=1, max_size=3))
def test_any_flags_and_values_are_a_valid_config_or_refused_naming_a_flag(capsys, algo, pairs):
    argv = ["--algo", algo]
    for name, value, joined in pairs:
        if FLAGS[name] is bool and not joined:
            argv.append(name)  # a switch takes no value
        else:
            argv += [f"{name}={value}"] if joined else [name, value]
    _check_command_line(argv, capsys)


def _owner(name: str) -> str:
    """An algorithm that reads option ``name`` (its own flags are refused under another)."""
    return next((a for a in ALGOS if name.lstrip("-").replace("-", "_") in _OWN[a]), "ssgd")


_OWN = {algo: {f.metadata.get("flag", f.name).replace("-", "_")
               for f in dataclasses.fields(type(parse_config(["--algo", algo]).algo_options()))}
        for algo in ALGOS}


def test_every_flag_with_every_adversarial_value(capsys):
    """The sweep behind the property: each of the parser's value flags x each string."""
    for name in sorted(FLAGS):
        if FLAGS[name] is bool:
            continue
        for value in _SWEPT:
            _check_command_line(["--algo", _owner(name), f"{name}={value}"], capsys)


_BAD_JSON = [None, True, -1, 2.5, 10**30, 10**400, 1e308, "", "four", "a\x00b", [1], {"a": 1}]


def test_every_key_with_every_adversarial_json_value(tmp_path, capsys):
    """The sweep behind the property: each key of config.json x each JSON value."""
    for section, name in _KEYS:
        algo = _owner(name)
        for value in _BAD_JSON:
            doc = json.loads(json.dumps(_DEFAULTS[algo]))
            doc[section][name] = value
            got = _parse(["--config", _write(tmp_path, doc)], capsys)
            if isinstance(got, str):
                dashed = "--" + name.replace("_", "-")
                assert f"{section}.{name}" in got or dashed in got, (section, name, value, got)
                continue
            _assert_valid(got)
            kept = to_dict(got)[section][name]
            if value is None:
                continue  # the option's default (the resolved --lr, BMUF's 1 - 1/N)
            assert kept == (float(value) if isinstance(kept, float) else value), \
                (section, name, value, kept)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--epochs", "１２"], "--epochs"),
    (["--epochs", "1_000"], "--epochs"),
    (["--lr", " 3"], "--lr"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(10**30)], "--seed"),
    (["--out-dir", ""], "--out-dir"),
    (["--resume", ""], "--resume"),
    (["--allow-resume-change", "bath-size"], "--allow-resume-change"),
    (["--grad-bucket-mb", "1e308"], "--grad-bucket-mb"),
])
def test_found_command_lines_are_refused(capsys, argv, needle):
    got = _parse(argv, capsys)
    assert isinstance(got, str) and needle in got, got


@pytest.mark.parametrize(("text", "needle"), [
    ('{"optim": {"lr": 1' + "0" * 400 + "}}", "optim.lr must be a finite number"),
    ('{"train": {"epochs": 1000000000000000000000000000000}}', "train.epochs must be at most"),
    ('{"train": {"epochs": 2, "epochs": 3}}', "'epochs' is given twice"),
    ('{"epochs": 2, "train": {"epochs": 3}}', "epochs is given twice"),
    ('{"optim": {"epochs": 3}}', "optim.epochs belongs to the section train"),
    ('{"model": 3}', "the section model must be a JSON object"),
    ('{"data": {"train": "a\\u0000", "heldout": "b"}}', "--train"),
])
def test_found_config_files_are_refused(tmp_path, capsys, text, needle):
    path = tmp_path / "c.json"
    path.write_text(text)
    got = _parse(["--config", str(path)], capsys)
    assert isinstance(got, str) and needle in got, got
