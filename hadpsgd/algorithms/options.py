"""The base of every algorithm's options: one name per option, its flag, its validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hadpsgd.cli import ConfigError, check_finite, flag, option_name
from hadpsgd.comm.codec import SPARSE_WIRES, WIRES, wire_spec


@dataclass(frozen=True)
class AlgoOptions:
    """Base of an algorithm's options (a frozen dataclass beside the algorithm).

    A field's name is the option's one name: the constructor's keyword, the attribute of the
    algorithm's :attr:`Algorithm.options` and its flag (``sync_period`` -> ``--sync-period``),
    unless the field's metadata gives the flag another spelling (``{"flag": "bmuf-overlap"}``,
    for a name too generic among every algorithm's flags). Field docstrings are the help,
    ``__post_init__`` the validation (raising :class:`hadpsgd.cli.ConfigError` that names the
    flag). The run configuration and the sweep tool read them from the registry.
    """

    @classmethod
    def from_section(cls, section: Any) -> AlgoOptions:
        """These options, picked from a run configuration's ``algo`` section (and validated).

        The section holds every algorithm's options by their names among the run's flags
        (:func:`hadpsgd.cli.option_name`).
        """
        return cls(**{f.name: getattr(section, option_name(f)) for f in dataclasses.fields(cls)})

    @classmethod
    def resolve(cls, options: AlgoOptions | None, values: Mapping[str, Any]) -> AlgoOptions:
        """A constructor's options: ``options`` as built and validated, or built from ``values``.

        Raises:
            TypeError: For both, options of another algorithm, or a keyword that is no option.
            ConfigError: For a value out of range (naming the flag).
        """
        if options is None:
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(values) - names)
            if unknown:
                raise TypeError(f"unknown option(s) {', '.join(unknown)}; {cls.__name__} has "
                                f"{', '.join(sorted(names)) or 'none'}")
            return cls(**values)
        if values:
            raise TypeError(f"give options= or the option keywords {sorted(values)}, not both")
        if not isinstance(options, cls):
            raise TypeError(f"expected {cls.__name__}, got {type(options).__name__}")
        return options

    def flag(self, name: str) -> str:
        """The command-line flag of option ``name`` (for messages)."""
        return flag(name, self)

    def check_choices(self) -> None:
        """Refuse a field outside the ``choices`` its metadata declares, naming the flag.

        The generated CLI already restricts such flags; this catches ``--config`` files and
        direct construction. Call it from ``__post_init__``.

        Raises:
            ConfigError: For the first such field.
        """
        check_finite(self)  # NaN and infinity pass every range check after this
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            # None where the field allows it: "the default for the rest of the options".
            if choices is not None and value not in choices and not (
                    value is None and f.default is None):
                raise ConfigError(f"{flag(option_name(f))} must be one of {', '.join(choices)}, "
                                  f"got {value!r}")

    def ranks_per_node(self) -> int | None:
        """Learners per super-learner this algorithm asks for (None: the nodes as they are)."""
        return None

    def check_read(self, given: Iterable[str]) -> None:
        """Refuse an option the user gave that these options, as chosen, never read.

        An option of another algorithm is the configuration's to refuse; this is for one of
        this algorithm's that another of its choices makes idle (a wire's own option under
        another wire). None by default.

        Args:
            given: The options the user gave explicitly, by name.

        Raises:
            ConfigError: For the first such option, naming its flag and the fix.
        """

    # One line for --help: the defaults recipe() sets (empty if none). A comment, not a
    # docstring, so that the generated CLI does not take it for an option.
    recipe_help: ClassVar[str] = ""

    @classmethod
    def recipe(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults this algorithm gives to options the user did not set.

        Args:
            given: The options set on the command line (flag names with ``_``).

        Returns:
            Option name -> value, only for options absent from ``given``; shared options
            (``optimizer``, ``beta1``) as well as the algorithm's own.
        """
        return {}

    @classmethod
    def recipe_line(cls, algo: str, optimizer: str, filled: Mapping[str, Any],
                    spell: Callable[[str, Any], str]) -> str | None:
        """The one line that says what :meth:`recipe` filled in, or None if nothing.

        ``python -m hadpsgd.run`` and :class:`hadpsgd.Distributed` resolve the recipe alike
        (from the optimizer's kind) and say it alike, each in its own words.

        Args:
            algo: The algorithm's registered name.
            optimizer: The optimizer's kind (``sgd``, ``adam``, ...).
            filled: Option name (the run's, as :meth:`recipe` returns it) -> value filled.
            spell: How the caller writes an option and its value (``--bmuf-worker-lr
                global`` for the CLI, ``worker_lr='global'`` for the API).
        """
        shown = {k: v for k, v in filled.items() if k != "optimizer"}
        if not shown:
            return None
        return (f"{algo} with {optimizer}: {', '.join(spell(k, v) for k, v in shown.items())} "
                f"(the recipe for {optimizer}, for what was not given; give any of them to "
                f"choose otherwise)")


@dataclass(frozen=True)
class WireOptions(AlgoOptions):
    """Base of the options of an algorithm whose inter-node exchanges take a ``--wire``.

    BMUF's block sync and ADPSGD's gossip share the flag, its text and its checks: one
    declaration here. A subclass's ``__post_init__`` calls :meth:`check_wire`.
    """

    wire: str = field(default="fp32", metadata={"choices": WIRES})
    """Wire format of the inter-node exchanges (BMUF's block sync, ADPSGD's gossip): fp32
    (as is), bf16, int8 or int4 with one scale per 1024 values, sign (one bit a value and
    one scale per 4096, 1-bit SGD's code: ~32x below fp32), signtopk (per 4096 values the
    signs of the largest, 112 by default, their places packed, 8 bits each, one scale:
    ~139x below fp32), or topk (per 4096 values the largest fraction, 12-bit indices,
    2-bit values; ~141x below fp32 at 1/64); ADPSGD sends sign, topk and signtopk as
    CHOCO-SGD's compressed differences; compressed formats carry their rounding error into
    the next exchange (error feedback)."""
    topk_fraction: float | None = None
    """--wire topk or signtopk: the fraction of each chunk of 4096 values sent, in (0, 1];
    default the wire's own: topk 1/64 = 0.015625 (64 values a chunk, 14 bits each and 4
    more bytes a chunk), signtopk 112/4096 = 0.02734375 (8 bits each: a block of 8 steps at
    ~1,100x fewer bytes than SSGD fp32); BMUF's block sync scales it to its block, keeping
    those bytes a step (signtopk 46 of 4,096 at a block of 4, 16 workers' default; said at
    start). The rest waits in the error-feedback residual or the worker's model for a later
    exchange."""

    # The options only some wires read, and those wires (a comment, not a docstring, so that
    # the generated CLI does not take it for an option).
    wire_readers: ClassVar[dict[str, tuple[str, ...]]] = {"topk_fraction": SPARSE_WIRES}

    def check_read(self, given: Iterable[str]) -> None:
        """Refuse a wire's own option given with another wire (``--topk-fraction`` with sign).

        Silently ignored, it would run something else than the user asked for, as an option
        of another algorithm would (:meth:`AlgoOptions.check_read`).

        Raises:
            ConfigError: For the first such option, naming it, the wire and the fix.
        """
        for name in given:
            wires = self.wire_readers.get(name, (self.wire,))
            if self.wire not in wires:
                readers = " or ".join(f"{self.flag('wire')} {w}" for w in wires)
                raise ConfigError(f"{self.flag(name)} is read by {readers} only, not by "
                                  f"{self.flag('wire')} {self.wire}; drop it or choose "
                                  f"{readers}")

    def check_wire(self) -> None:
        """Refuse a choice outside its field's choices, or a top-k fraction outside (0, 1].

        :meth:`check_choices`, then the fraction; each error names the flag.

        Raises:
            ConfigError: For the first such value.
        """
        self.check_choices()
        if self.topk_fraction is not None and not 0.0 < self.topk_fraction <= 1.0:
            raise ConfigError(f"{self.flag('topk_fraction')} must be in (0, 1] (the fraction of "
                              f"each 4096-value chunk --wire {' or '.join(SPARSE_WIRES)} "
                              f"sends, e.g. 0.015625), got {self.topk_fraction}")

    @property
    def wire_spec(self) -> str:
        """The wire as the codec names it: ``<wire>:<fraction>`` for a sparse one, else ``wire``."""
        return wire_spec(self.wire, self.topk_fraction)
