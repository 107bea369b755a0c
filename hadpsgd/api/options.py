"""The options of :class:`hadpsgd.Distributed`, checked before any communication.

An algorithm's own options are built by its ``Options`` dataclass (the one place they are
defined and validated, the same object ``python -m hadpsgd.run`` builds from its flags); the
options every algorithm shares (precision, clipping, overlap, gradient buckets and wire) are
checked here. Every refusal is an :class:`OptionError` that names the keyword as a Python user
wrote it (``sync_period``), not the command-line flag the dataclass's own message names
(``--sync-period``): the same check, in the caller's words.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Mapping
from typing import Any

from torch import nn

from hadpsgd.algorithms import AlgoOptions, AlgoSpec, names, spec
from hadpsgd.algorithms.base import missing_params_message, params_missing_from
from hadpsgd.algorithms.gradsync import GRAD_WIRES
from hadpsgd.cli import ConfigError, flag, option_name
from hadpsgd.comm import World
from hadpsgd.precision import PRECISIONS

SHARED_OPTIONS: tuple[str, ...] = ("precision", "max_grad_norm", "overlap", "grad_bucket_mb",
                                   "grad_wire")
"""The keywords every algorithm takes besides its own options."""

_OVERLAPS = (True, False, "on", "off", "auto")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


class OptionError(ConfigError):
    """An option of :class:`hadpsgd.Distributed` that cannot work (a ``ValueError``).

    Attributes:
        option: The keyword at fault (``sync_period``, ``precision``, ``algo``).
    """

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def algorithm_spec(algo: str) -> AlgoSpec:
    """The registry entry of ``algo``.

    Raises:
        OptionError: For a name that is not registered (the message lists those that are).
    """
    if not isinstance(algo, str):
        raise OptionError("algo", f"algo must be an algorithm's name ({', '.join(names())}), "
                                  f"got {algo!r}")
    try:
        return spec(algo)
    except ValueError as err:
        raise OptionError("algo", f"algo: {err}") from None


def build_options(entry: AlgoSpec, values: Mapping[str, Any],
                  built: AlgoOptions | None = None) -> AlgoOptions:
    """``entry``'s options from keywords: each checked for its name, type and range.

    Args:
        entry: The algorithm's registry entry.
        values: The algorithm's own options by name (the shared ones taken out).
        built: Or the options object itself, already built (and so validated).

    Returns:
        The validated, frozen options object the algorithm's constructor takes as ``options=``.

    Raises:
        OptionError: For an unknown keyword, a value of the wrong type or one out of range,
            or one the chosen ``wire`` does not read, naming the keyword.
    """
    if built is not None:
        if values:
            raise OptionError(sorted(values)[0], f"give options= or the option keywords "
                                                 f"{', '.join(sorted(values))}, not both")
        if not isinstance(built, entry.options):
            raise OptionError("options", f"options must be {entry.options.__name__} for "
                                         f"{entry.name}, got {type(built).__name__}")
        return built
    fields = {f.name: f for f in dataclasses.fields(entry.options)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        own = ", ".join(sorted(fields)) or "none"
        # Another algorithm's option says whose it is; a typo gets the keyword it resembles,
        # as the CLI's flags do.
        owners = [n for n in names() if n != entry.name and unknown[0] in
                  {f.name for f in dataclasses.fields(spec(n).options)}]
        near = difflib.get_close_matches(unknown[0], [*fields, *SHARED_OPTIONS], n=1,
                                         cutoff=0.8)
        hint = (f" (an option of {' and '.join(owners)})." if owners
                else f"; did you mean {near[0]}?" if near else ".")
        raise OptionError(unknown[0], f"{entry.name} has no option {', '.join(unknown)}{hint}"
                                      f" Its options are {own}, and every algorithm takes "
                                      f"{', '.join(SHARED_OPTIONS)}")
    hints = typing.get_type_hints(entry.options)
    for name, value in values.items():
        _check_type(entry.name, name, value, hints[name])
    try:
        options = entry.options(**values)
        options.check_read(values)  # a keyword the chosen wire never reads: not ignored
    except ConfigError as err:
        raise in_keywords(err, entry) from None
    return options


def _check_type(algo: str, name: str, value: Any, hint: Any) -> None:
    """Refuse ``value`` unless it is of the field's annotated type (an int does for a float).

    Without this a string or a bool would reach the dataclass's range checks, where ``"8" < 1``
    is a bare TypeError and ``True`` passes for 1.
    """
    allowed = set(typing.get_args(hint)) or {hint}
    if float in allowed:
        allowed.add(int)  # 1 is a fine block_lr; the dataclass keeps what it is given
    kind = type(value)
    ok = kind in allowed or (kind is not bool and any(
        isinstance(value, t) for t in allowed if t is not type(None) and t is not bool))
    if not ok:
        wanted = " or ".join(sorted("None" if t is type(None) else t.__name__ for t in allowed))
        raise OptionError(name, f"{algo} option {name} must be {wanted}, got {value!r}")


def _keywords_by_flag(*entries: AlgoSpec) -> dict[str, str]:
    """Each option's command-line flag -> its keyword, over the algorithms ``entries``."""
    return {flag(option_name(f)): f.name for entry in entries
            for f in dataclasses.fields(entry.options)}


_NODES = re.compile(r"--ranks-per-node( [0-9]+| K| N)?")
_FLAG_VALUE = re.compile(r"(--[a-z0-9][a-z0-9-]*)( [0-9][0-9.e+-]*)?")


def api_words(text: str) -> str:
    """``text`` (a message of the run's) with the knobs an API script has for its flags.

    ``--ranks-per-node K`` is ``hadpsgd.init(ranks_per_node=K)`` (or
    ``HADPSGD_RANKS_PER_NODE``); an algorithm's flag is its keyword of
    :class:`hadpsgd.Distributed` (``--sync-period 4`` -> ``sync_period=4``,
    ``--bmuf-overlap`` -> ``block_overlap``); any other flag is left as it is.
    """
    def nodes(m: re.Match[str]) -> str:
        value = (m.group(1) or " K").strip()
        return (f"hadpsgd.init(ranks_per_node={value}) (or HADPSGD_RANKS_PER_NODE={value})")

    text = _NODES.sub(nodes, text)
    by_flag = _keywords_by_flag(*(spec(name) for name in names()))

    def keyword(m: re.Match[str]) -> str:
        name = by_flag.get(m.group(1))
        if name is None:
            return m.group(0)
        return f"{name}={m.group(2).strip()}" if m.group(2) else name

    return _FLAG_VALUE.sub(keyword, text)


def in_keywords(err: ConfigError, entry: AlgoSpec, prefix: bool = True) -> OptionError:
    """The dataclass's message with its flags as the keywords a Python caller wrote.

    ``prefix``: start it with ``<algorithm> option`` (a message about one option's value).
    """
    # The keywords every algorithm shares (Distributed's max_grad_norm=, ...) are flags of
    # the run's too, and a recipe's message may name them.
    by_flag = {**{flag(name): name for name in SHARED_OPTIONS}, **_keywords_by_flag(entry)}
    message = str(err)
    found = [by_flag[m] for m in _FLAG.findall(message) if m in by_flag]
    text = _FLAG.sub(lambda m: by_flag.get(m.group(0), m.group(0)), message)
    return OptionError(found[0] if found else "options",
                       f"{entry.name} option {text}" if prefix else text)


def check_shared(precision: str, max_grad_norm: float, overlap: bool | str,
                 grad_bucket_mb: float, grad_wire: str) -> None:
    """Refuse a shared option that cannot work (see :class:`hadpsgd.Distributed`).

    Raises:
        OptionError: Naming the keyword.
    """
    if precision not in PRECISIONS:
        raise OptionError("precision", f"precision must be one of {', '.join(PRECISIONS)}, "
                                       f"got {precision!r}")
    if grad_wire not in GRAD_WIRES:
        raise OptionError("grad_wire", f"grad_wire must be one of {', '.join(GRAD_WIRES)}, "
                                       f"got {grad_wire!r}")
    if overlap not in _OVERLAPS or (not isinstance(overlap, bool) and overlap in (0, 1)):
        raise OptionError("overlap", f"overlap must be True, False, 'on', 'off' or 'auto', "
                                     f"got {overlap!r}")
    for name, value, low in (("max_grad_norm", max_grad_norm, "a number >= 0 (0 disables)"),
                             ("grad_bucket_mb", grad_bucket_mb, "a number > 0")):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        # Written so that NaN fails: it compares false with everything.
        in_range = number and (value >= 0 if name == "max_grad_norm" else value > 0)
        if not (in_range and value != float("inf")):
            raise OptionError(name, f"{name} must be {low} and finite, got {value!r}")


def check_layout(opts: AlgoOptions, topo: World) -> None:
    """Refuse a topology whose super-learners are not those the options ask for."""
    wanted = opts.ranks_per_node()
    if wanted is None:
        return
    # What hadpsgd.init(ranks_per_node=wanted) makes: consecutive groups, the last one short.
    made = [min(wanted, topo.size - start) for start in range(0, topo.size, wanted)]
    if list(topo.node_sizes) != made:
        raise OptionError("super_learner_size",
                          f"super_learner_size={wanted} needs super-learners of {wanted} "
                          f"learners, but the topology's nodes have {topo.node_sizes}: make "
                          f"it with hadpsgd.init(ranks_per_node={wanted}), or leave topology "
                          "out")


def check_device(model: nn.Module, topo: World) -> None:
    """Refuse a model whose parameters are not on the topology's device (an OptionError)."""
    elsewhere = {str(p.device) for p in model.parameters() if p.device != topo.device}
    if elsewhere:
        where = ", ".join(sorted(elsewhere))
        raise OptionError("model", f"the model has parameters on {where}, but this learner "
                                   f"computes on {topo.device}: model.to(topology.device) first")


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that leaves out trainable parameters of the model (an OptionError).

    The algorithm refuses it too (a plain ``ValueError``); here it is a user's mistake said
    as every other one is: once, exit 2 (docs/api.md).
    """
    missing = params_missing_from(model, optimizer)
    if missing:
        raise OptionError("optimizer", missing_params_message(missing))


__all__ = ["SHARED_OPTIONS", "OptionError", "algorithm_spec", "build_options", "check_device",
           "check_layout", "check_optimizer", "check_shared", "in_keywords"]
