"""Generate an argparse CLI from configuration dataclasses and their field docstrings.

The lowest layer of the configuration: it imports nothing from the rest of ``hadpsgd``, so
the algorithms can declare their own option dataclasses with it (see ``docs/design.md``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
import warnings
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin, get_type_hints

_LAUNCH_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def launch_rank(default: int = 0) -> int:
    """The rank the launcher (``mpirun``, ``mpiexec``) gave this process, else ``default``.

    Read from the launcher's environment, before MPI starts; a process keeps it when the
    survivors of a failure renumber themselves (``--on-failure continue``).
    """
    import os

    for name in _LAUNCH_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


RANK_ZERO_GRACE_S = 15.0
"""How long a rank whose error launch rank 0 says for it waits before it exits."""


def leave_it_to_rank_zero() -> None:
    """On a launch rank other than 0, wait for rank 0 to say the error all ranks found.

    For an error found before MPI starts, the same on every rank (the same arguments):
    only rank 0 says it. But Open MPI ends the whole job at the first non-zero exit, and a
    rank that exits before rank 0 has said it would leave nothing said; rank 0's own exit
    ends this wait (the job ends), else it ends after :data:`RANK_ZERO_GRACE_S`.
    """
    import time

    if launch_rank() != 0:
        time.sleep(RANK_ZERO_GRACE_S)


class RankParser(argparse.ArgumentParser):
    """An argument parser whose errors only the launch's rank 0 prints.

    Under ``mpirun`` every rank parses the same command line and refuses it alike (exit 2,
    before MPI starts): one copy of the usage and the error is enough, not one per rank.
    """

    USAGE_LINES = 4
    """Longer usages are not printed with an error: the error would be the last of ~50 lines."""

    def error(self, message: str) -> typing.NoReturn:  # noqa: D102
        if launch_rank() != 0:
            leave_it_to_rank_zero()
            self.exit(2)
        message += self._suggestions(message)
        usage = self.format_usage()
        if usage.count("\n") <= self.USAGE_LINES:
            super().error(message)
        # The error first, where the eye lands; the options on request (issue 60 item 5).
        self.exit(2, f"{self.prog}: error: {message}\n(usage: {self.prog} [options]; "
                     f"{self.prog} --help lists them)\n")

    def _suggestions(self, message: str) -> str:
        """``; did you mean --epochs?`` for each unknown flag in ``message`` that is near one.

        Python 3.12's argparse suggests nothing for a mistyped flag, and with
        ``allow_abbrev=False`` ``--epoch`` is simply unknown.
        """
        head, _, unknown = message.partition("unrecognized arguments: ")
        if head or not unknown:
            return ""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        flags = [w.partition("=")[0] for w in unknown.split() if w.startswith("--")]
        hints = []
        for name in flags:
            near = difflib.get_close_matches(name, known, n=1)
            if near:  # several unknown flags: say which each suggestion is for
                hints.append(f"did you mean {near[0]}" + (f" for {name}?" if len(flags) > 1
                                                          else "?"))
        return "; " + "; ".join(hints) if hints else ""


_PLAIN_FORMAT = warnings.formatwarning
_TRANSLATE: list[Callable[[str], str]] = []
"""How hadpsgd's warnings name their knobs for this process's user (an API script: keywords)."""


def _format_warning(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, line: str | None = None, **kw: Any) -> str:
    """Hadpsgd's own runtime warnings as one log line; any other warning as Python says it."""
    if issubclass(category, RuntimeWarning) and "hadpsgd" in filename:
        text = str(message)
        for translate in _TRANSLATE:
            text = translate(text)
        return f"[hadpsgd] warning: {text}\n"
    return _PLAIN_FORMAT(message, category, filename, lineno, line)


def install_warning_format(translate: Callable[[str], str] | None = None) -> None:
    """Say hadpsgd's own warnings (a run that is not what it seems) as ``[hadpsgd] warning:``.

    Installed by ``hadpsgd.run`` and by :func:`hadpsgd.init`: a script's user saw a raw
    ``RuntimeWarning`` with hadpsgd's file and line (issue 60 item 5). Other warnings keep
    Python's format.

    Args:
        translate: Rewrites a warning's text for this process's user: the API's names its
            keywords where the text names the run's flags (a script has no flags).
    """
    warnings.formatwarning = _format_warning
    _TRANSLATE[:] = [translate] if translate is not None else []


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the option and the fix."""


MAX_INT = 2**63 - 1
"""The largest integer option: counts, steps and seeds end up in int64 tensors and RNG seeds."""

# What a user types for a number: ASCII digits only. Python's int() and float() also read
# "1_000", " 3" and full-width digits ("１２"), which no shell script or config.json holds.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|nan|inf|infinity)",
                    re.IGNORECASE)  # nan and inf match, to be refused as no finite number


def _shown(text: str) -> str:
    """``text`` for a message, cut short: a flag's value can be arbitrarily long."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def plain_int(text: str) -> int:
    """Argparse's type of every integer option: decimal digits, within a 64-bit integer."""
    if not _INT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a whole number (decimal digits), got "
                                         f"{_shown(text)}")
    # Long strings first: int() refuses more than 4300 digits with a ValueError of its own.
    if len(text.lstrip("+-").lstrip("0")) > 19 or abs(int(text)) > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INT} in size, got "
                                         f"{_shown(text)}")
    return int(text)


def finite_float(text: str) -> float:
    """Argparse's type of every float option: a finite number (NaN and infinity refused).

    ``float()`` reads ``nan``, ``inf`` and ``1e400``; none is a learning rate, a momentum or
    a bucket size, and a NaN passes every ``<`` range check after it.
    """
    if not _FLOAT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a number, got {_shown(text)}")
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {_shown(text)}")
    return value


def check_finite(obj: Any) -> None:
    """Refuse a float field of dataclass ``obj`` that is NaN or infinite, naming its flag.

    Also an integer field beyond :data:`MAX_INT` (``10**30`` steps or as a seed fails deep
    in torch or numpy, not here).

    For values that come from elsewhere than the command line (``--config`` files, direct
    construction); call it first in ``__post_init__``.

    Raises:
        ConfigError: For the first such field.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag(option_name(f), obj)} must be a finite number, got "
                              f"{value}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ConfigError(f"{flag(option_name(f), obj)} must be at most {MAX_INT} in "
                              f"size, got {value}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name.

    Attribute docstrings are not kept at run time, so read them from the class source, and
    from its dataclass bases' for the fields it inherits (a subclass's own text wins). A
    generated dataclass (no source) carries them in ``__field_docs__``.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """:func:`field_docs` of the fields ``cls``'s own body declares."""
    if "__field_docs__" in cls.__dict__:
        return dict(cls.__dict__["__field_docs__"])
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    assert isinstance(body, ast.ClassDef)
    for node, nxt in zip(body.body, body.body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def option_name(f: dataclasses.Field) -> str:
    """A field's name in the run's one namespace of options (argparse, ``config.json``).

    The field's own name, unless its metadata gives a ``flag`` (without the dashes): a field
    whose name is too generic for the flags of every algorithm together keeps it in its own
    code (``warmup_steps``) and takes the flag's spelling there (``bmuf_warmup_steps``).
    """
    return f.metadata.get("flag", f.name).replace("-", "_")


def flag(name: str, owner: Any = None) -> str:
    """The command-line flag of a field name (``batch_size`` -> ``--batch-size``).

    Args:
        name: The field's name.
        owner: The dataclass (or an instance) that declares it, whose metadata may give the
            field another flag (see :func:`option_name`).
    """
    if owner is not None:
        for f in dataclasses.fields(owner):
            if f.name == name:
                name = option_name(f)
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _choices(f: dataclasses.Field, tp: Any) -> list[Any] | None:
    if "choices" in f.metadata:
        choices = f.metadata["choices"]
        return list(choices() if callable(choices) else choices)
    if get_origin(tp) is Literal:
        return list(get_args(tp))
    return None


def add_arguments(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one option per field of dataclass ``cls`` (recursing into nested dataclasses)."""
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    # A generated class may sort its fields into titled groups (one per algorithm).
    titled: dict[str, str] = cls.__dict__.get("__field_groups__", {})
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            add_arguments(parser, tp)  # type: ignore[arg-type]
            continue
        heading = titled.get(f.name) or title or cls.__name__
        if heading not in groups:  # only classes with own options get a help section
            groups[heading] = parser.add_argument_group(
                heading, None if f.name in titled else (cls.__doc__ or "").split("\n")[0])
        group = groups[heading]
        base, optional = _unwrap_optional(tp)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        dest = option_name(f)
        if base is bool:
            group.add_argument(flag(dest), dest=dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
            continue
        choices = _choices(f, base)
        conv = (str if get_origin(base) is Literal else finite_float if base is float
                else plain_int if base is int else base)
        metavar = None if choices else ("N" if base is int else "X" if base is float else "STR")
        # A field whose metadata has a "const" takes an optional value: the flag alone is it.
        extra = {"nargs": "?", "const": f.metadata["const"]} if "const" in f.metadata else {}
        group.add_argument(
            flag(dest), dest=dest, type=conv, choices=choices, metavar=metavar,
            default=argparse.SUPPRESS,
            help=f"{help_text} (default: {default}{', optional' if optional else ''})",
            **extra,
        )


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """Build dataclass ``cls`` from parsed options; options not given keep field defaults."""
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = from_namespace(tp, ns)  # type: ignore[arg-type]
        elif hasattr(ns, option_name(f)):
            kwargs[f.name] = getattr(ns, option_name(f))
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """A JSON-ready dict of a (nested) configuration dataclass."""
    return dataclasses.asdict(obj)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Inverse of :func:`to_dict` (unknown keys are an error naming them)."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    kwargs = {k: from_dict(hints[k], v) if dataclasses.is_dataclass(hints[k]) else v
              for k, v in data.items()}
    return cls(**kwargs)
