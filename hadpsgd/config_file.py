"""``--config FILE``: options from a JSON file with the sections of ``config.json``.

A run's ``config.json`` can be given back as it is: its sections (:data:`SECTIONS`) hold the
options by their field names, and what is not an option (``world``, ``provenance``) is
skipped; a file written before an option moved section holds it in its former one, and is
read as it was (``former``). Options given on the command line win
over the file; the file wins over the defaults and over an algorithm's recipe.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from hadpsgd.cli import MAX_INT, ConfigError

SECTIONS = ("data", "model", "optim", "train", "checkpoint", "failure", "precision", "algo",
            "comm")
"""The sections of ``config.json`` that hold options."""
SKIPPED = ("world", "provenance")
"""Top-level keys of ``config.json`` that record the run rather than configure it."""


def _kind(tp: Any) -> tuple[Any, bool]:
    """``tp`` without ``| None``, and whether None is allowed."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def checked_value(where: str, value: Any, tp: Any) -> Any:
    """``value`` for an option of type ``tp``, or a ConfigError naming ``where``.

    JSON has no int/float distinction for whole numbers, so an integer is a valid float;
    nothing else is converted (``"four"`` is no integer, ``2.5`` no step count).
    """
    base, optional = _kind(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} must not be null")
    if get_origin(base) is Literal:
        if value in get_args(base):
            return value
        raise ConfigError(f"{where} must be one of {', '.join(map(repr, get_args(base)))}, "
                          f"got {value!r}")
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(base)
    if ok is None or ok(value):
        if base is int and abs(value) > MAX_INT:  # 10**30 steps or seed fail deep in torch
            raise ConfigError(f"{where} must be at most {MAX_INT} in size, got {value}")
        if base is float:
            try:
                number = float(value)  # a JSON integer of 400 digits overflows here
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):  # json reads NaN, Infinity, 1e400
                raise ConfigError(f"{where} must be a finite number, got {value}")
            return number
        return value
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    raise ConfigError(f"{where} must be {names[base]}, got {json.dumps(value)}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last one silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} is given twice in one object; keep one")
        seen[key] = value
    return seen


def read_config_file(path: str, options: Iterable[str] | Mapping[str, Any],
                     sections: Mapping[str, str] | None = None,
                     former: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options in the JSON file ``path``, flattened to ``{field name: value}``.

    Args:
        path: The file.
        options: Every option's field name (``sync_period``, ``lr``, ...); given as a mapping
            to its type, every value is checked against it (:func:`checked_value`).
        sections: Every option's section (``lr`` -> ``optim``); given, an option in another
            section than its own is refused.
        former: The section an option was in before it moved (``precision`` -> ``train``),
            where an older ``config.json`` holds it: accepted there too.

    Raises:
        ConfigError: For a missing or malformed file, a key that is no option, or a value of
            the wrong type, naming it.
    """
    where = Path(path)
    try:
        data = json.loads(where.read_text(), object_pairs_hook=_unique_keys)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--config {path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a JSON object with the sections "
                          f"{', '.join(SECTIONS)} (as in a run's config.json)")
    known = set(options)
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SKIPPED:
            continue
        if key in SECTIONS and isinstance(value, dict):
            items = value.items()
        elif key in known:  # a flat file ({"lr": 0.1}) is accepted too
            items = [(key, value)]
        elif key in SECTIONS:
            raise ConfigError(f"--config {path}: the section {key} must be a JSON object of "
                              f"options, got {_shown(value)}")
        else:
            raise ConfigError(f"--config {path}: unknown key {key!r}; use the sections "
                              f"{', '.join(SECTIONS)} or option names (see --print-config)")
        for name, val in items:
            if name not in known:
                raise ConfigError(f"--config {path}: {key}.{name} is no option of "
                                  "python -m hadpsgd.run (see --print-config for the keys)")
            own = sections.get(name, key) if sections is not None else key
            moved = former is not None and former.get(name) == key
            if key in SECTIONS and isinstance(value, dict) and own != key and not moved:
                raise ConfigError(f"--config {path}: {key}.{name} belongs to the section "
                                  f"{own}: move it to {own}.{name}")
            if name in flat:
                raise ConfigError(f"--config {path}: {name} is given twice (flat and in its "
                                  f"section {own}); keep one")
            if isinstance(options, Mapping):
                # "precision" is a section and an option: its object holds precision.precision
                in_section = key in SECTIONS and isinstance(value, dict)
                where = f"--config {path}: {key}.{name}" if in_section else (
                    f"--config {path}: {name}")
                try:
                    val = checked_value(where, val, options[name])
                except ConfigError as err:
                    if key not in SECTIONS or isinstance(value, dict):
                        raise
                    # "train" and "algo" are sections and options (data.train, train.algo)
                    raise ConfigError(f"{err} (or, as the section {key}, a JSON object of "
                                      "options)") from None
            flat[name] = val
    return flat


def _shown(value: Any) -> str:
    """A JSON value for a message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:60] + "..."


def merge(given: Mapping[str, Any], from_file: Mapping[str, Any], algo: str,
          owners: Mapping[str, list[str]]) -> dict[str, Any]:
    """The file's options to add: those not given, without other algorithms' own options.

    A run's ``config.json`` records every algorithm's options; those of algorithms other
    than ``algo`` are dropped rather than refused.
    """
    return {name: value for name, value in from_file.items()
            if name not in given and (name not in owners or algo in owners[name])}
