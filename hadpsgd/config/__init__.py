"""Run configuration: dataclasses whose field docstrings become the ``hadpsgd.run`` CLI help.

Every value is checked at construction, and errors name the option and what to change.
``config.json`` holds one section per owner: ``data``, ``model``, ``optim``, ``comm``
(:mod:`hadpsgd.config.sections`), ``train``, ``checkpoint``, ``failure``, ``precision``
(:mod:`hadpsgd.config.training`) and ``algo`` (every algorithm's own options, from the
registry). Every option has one flag, whatever its section.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from hadpsgd import algorithms
from hadpsgd.cli import (
    ConfigError,
    RankParser,
    add_arguments,
    check_finite,
    field_docs,
    flag,
    from_namespace,
    option_name,
    to_dict,
)
from hadpsgd.config.sections import (
    DEFAULT_LR,
    MAX_BUCKET_MB,
    CommConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
)
from hadpsgd.config.training import (
    ELASTIC_ALGOS,
    FORMER_SECTION,
    CheckpointConfig,
    FailureConfig,
    PrecisionConfig,
    TrainConfig,
)
from hadpsgd.config_file import merge, read_config_file

__all__ = ["DEFAULT_LR", "ELASTIC_ALGOS", "FORMER_SECTION", "MAX_BUCKET_MB", "AlgoConfig",
           "CheckpointConfig", "CommConfig", "ConfigError", "DataConfig", "FailureConfig",
           "ModelConfig", "OptimConfig", "PrecisionConfig", "RunConfig", "TrainConfig",
           "check_read", "parse_config", "run_parser"]


def _algo_config() -> type:
    """The ``algo`` section: every registered algorithm's options, generated from the registry.

    Each algorithm defines and validates its options in its own module (``Options``); this
    class only gathers them, so adding an algorithm or an option touches that module alone.
    Its fields are named as the run's flags and ``config.json`` name them
    (:func:`hadpsgd.cli.option_name`: ``bmuf_warmup_steps`` for BMUF's ``warmup_steps``).
    ``--help`` shows one group per algorithm. An option shared by several algorithms must be
    declared alike in each. The chosen algorithm validates its own, once
    (:meth:`RunConfig.algo_options`).
    """
    fields: dict[str, tuple[str, Any, dataclasses.Field]] = {}
    docs: dict[str, str] = {}
    groups: dict[str, str] = {}
    owners: dict[str, list[str]] = {}
    for spec in algorithms.specs():
        hints = get_type_hints(spec.options)
        for f in dataclasses.fields(spec.options):
            name = option_name(f)
            owners.setdefault(name, []).append(spec.name)
            if name in fields:
                continue
            default = (field(default=f.default, metadata=f.metadata)
                       if f.default is not dataclasses.MISSING
                       else field(default_factory=f.default_factory, metadata=f.metadata))
            fields[name] = (name, hints[f.name], default)
            docs[name] = field_docs(spec.options).get(f.name, "")
            groups[name] = f"--algo {spec.name}: {spec.description}"

    return dataclasses.make_dataclass(
        "AlgoConfig", list(fields.values()),
        namespace={"__field_docs__": docs,
                   "__field_groups__": groups, "__owners__": owners,
                   "__doc__": "Options of the distributed algorithms (from the registry).",
                   "__module__": __name__})


AlgoConfig = _algo_config()


@dataclass
class RunConfig:
    """Everything ``python -m hadpsgd.run`` needs."""

    data: DataConfig = field(default_factory=DataConfig)
    """Data options."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model options."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule options."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop options."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint and resume options."""
    failure: FailureConfig = field(default_factory=FailureConfig)
    """Failure options."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Precision options."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # type: ignore[valid-type]
    """Algorithm options."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication options."""

    def __post_init__(self) -> None:
        check_finite(self)
        _check_resume_changes(self.checkpoint.allow_resume_change)
        if self.checkpoint.resume == "auto" and self.train.out_dir is None:
            raise ConfigError("--resume auto needs --out-dir (the run directory to resume)")
        if self.failure.on_failure == "continue" and self.train.algo not in ELASTIC_ALGOS:
            raise ConfigError(f"--on-failure continue is built for --algo "
                              f"{' and '.join(ELASTIC_ALGOS)}; --algo {self.train.algo} stops "
                              "at a failure (bounded in time) and resumes from its checkpoint: "
                              "drop --on-failure continue")
        # Built and validated here, once: the assembly hands this very object to the
        # algorithm, and run.main asks it for the layout (ADPSGD's super-learners).
        self._algo_options = algorithms.spec(self.train.algo).options.from_section(self.algo)
        # One setting, two flags: ADPSGD's super-learner is its node, so --super-learner-size
        # sets the node size as --ranks-per-node does, and silently one would lose.
        asked = self._algo_options.ranks_per_node()
        nodes = self.comm.ranks_per_node
        if asked is not None and nodes is not None and asked != nodes:
            raise ConfigError(f"--super-learner-size {asked} and --ranks-per-node {nodes} both "
                              "set the learners per super-learner (consecutive ranks, one "
                              "emulated node each); give one of them")

    def given(self) -> dict[str, Any]:
        """The options the user gave (command line and ``--config`` file), by option name.

        Empty for a configuration built in code. A resume takes every other option from the
        run it continues (:mod:`hadpsgd.assembly.resume_config`).
        """
        return dict(getattr(self, "_given", {}))

    def typed(self) -> set[str]:
        """The options given on the command line (not by a ``--config`` file), by name.

        Empty for a configuration built in code. An option of the run's algorithm that its
        other choices leave unread is refused only where typed (a run's ``config.json`` holds
        every option): :meth:`AlgoOptions.check_read`.
        """
        return set(getattr(self, "_typed", set()))

    def recipe_note(self) -> str | None:
        """The line that says what ``--algo``'s recipe filled in, or None.

        None where nothing was filled: a resume (its options are the run's it continues), a
        configuration built in code (no recipe ran), or every option given. The API says
        its recipe in the same words (:mod:`hadpsgd.api.recipe`).
        """
        if self.checkpoint.resume or not hasattr(self, "_given"):
            return None
        options = algorithms.spec(self.train.algo).options
        if self.optim.recipe == "none":
            filled = options.recipe({**self.given(), "optimizer": self.optim.optimizer})
            return (f"{self.train.algo}: --recipe none, so every option left out keeps its "
                    "own default" + (f" (the recipe would have set "
                                      f"{', '.join(flag(k) for k in filled)})" if filled
                                      else ""))
        return options.recipe_line(self.train.algo, self.optim.optimizer,
                                   options.recipe(self.given()),
                                   lambda name, value: f"{flag(name)} {value}")

    def algo_options(self) -> algorithms.AlgoOptions:
        """The options of ``--algo``'s algorithm, picked from :attr:`algo` and validated.

        Raises nothing: a bad value was a :class:`ConfigError` when this was constructed.
        """
        return self._algo_options


def _check_resume_changes(text: str | bool | None) -> None:
    """Refuse an ``--allow-resume-change`` list naming no flag of the run, or none at all."""
    if not isinstance(text, str):
        return
    names = set(_option_types(RunConfig)) | {"np", "all"}
    parts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in parts if p.lstrip("-").replace("-", "_") not in names]
    if not parts or unknown:
        raise ConfigError(f"--allow-resume-change takes flags of python -m hadpsgd.run "
                          f"(comma-separated, e.g. lr,batch-size; np for another number of "
                          f"ranks), or nothing for all of them; got {text!r}")


def _foreign_options(given: Iterable[str], algo: str) -> list[str]:
    """Options among ``given`` that belong only to other algorithms than ``algo``."""
    owners: dict[str, list[str]] = AlgoConfig.__owners__  # type: ignore[attr-defined]
    names = set(given)
    return [f"{flag(name)} (an option of --algo {' / '.join(who)})"
            for name, who in owners.items() if name in names and algo not in who]


def check_read(algo: str, given: Iterable[str], resumed: str | None = None) -> None:
    """Refuse an option in ``given`` that the algorithm ``algo`` does not read.

    Silently ignoring it would run something else than the user asked for.

    Args:
        algo: The run's ``--algo``.
        given: The options the user gave, by name.
        resumed: The checkpoint a resume continues, whose run's algorithm ``algo`` is (the
            one to check against, not the default ``--algo``).

    Raises:
        ConfigError: Naming each such flag, whose algorithm it is, and the fix.
    """
    foreign = _foreign_options(given, algo)
    if not foreign:
        return
    if resumed is None:
        raise ConfigError(f"--algo {algo} does not read {', '.join(foreign)}; drop it or "
                          "choose that algorithm")
    raise ConfigError(f"the run resumed from {resumed} is --algo {algo}, which does not read "
                      f"{', '.join(foreign)}; drop it to continue that run, or start a new "
                      "run of that algorithm in another --out-dir")


def run_parser() -> RankParser:
    """The parser of ``python -m hadpsgd.run``.

    Every option of :class:`RunConfig`, then ``--config`` and ``--print-config``. Its
    ``--help`` is the reference the docs' option tables are held to
    (``tests/unit/test_docs_flags.py``).
    """
    parser = RankParser(
        prog="python -m hadpsgd.run", allow_abbrev=False,
        description="Train the SWB BLSTM with SSGD, ADPSGD / H-ADPSGD or BMUF over MPI. "
                    "Launch with mpirun (one process per learner). Algorithms: "
                    + "; ".join(f"{s.name}: {s.description}" for s in algorithms.specs()),
        epilog=" ".join(s.options.recipe_help for s in algorithms.specs()
                        if s.options.recipe_help) or None,
    )
    add_arguments(parser, RunConfig)
    group = parser.add_argument_group("configuration file")
    group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help="read options from a JSON file with the sections of a run's "
                            "config.json; options on the command line win")
    group.add_argument("--print-config", action="store_true", default=argparse.SUPPRESS,
                       help="print the resolved configuration as JSON and exit")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse the command line into a validated :class:`RunConfig` (exits 2 on bad input)."""
    parser = run_parser()
    ns = parser.parse_args(argv)
    for name, value in vars(ns).items():
        if isinstance(value, list):  # argparse drops the value "--" of --lr=-- and leaves []
            parser.error(f"argument {flag(name)}: expected one value, got '--'")
    show = bool(vars(ns).pop("print_config", False))
    path = vars(ns).pop("config", None)
    owners: dict[str, list[str]] = AlgoConfig.__owners__  # type: ignore[attr-defined]
    # A --config file (a run's config.json) holds every option: only the typed ones are
    # refused where the chosen wire does not read them, as its other algorithms' are dropped.
    typed = set(vars(ns))
    if path is not None:
        try:
            from_file = read_config_file(path, _option_types(RunConfig),
                                         _option_sections(RunConfig), FORMER_SECTION)
        except ConfigError as err:
            parser.error(str(err))
        algo = getattr(ns, "algo", from_file.get("algo", TrainConfig.algo))
        for name, value in merge(vars(ns), from_file, algo, owners).items():
            setattr(ns, name, value)
    named = getattr(ns, "recipe", "auto")
    if named in ("sgd", "adam"):  # a recipe by name is its optimizer's
        if getattr(ns, "optimizer", named) != named:
            parser.error(f"--recipe {named} is the recipe of --optimizer {named}, but "
                         f"--optimizer {ns.optimizer} was given: drop one of them")
        ns.optimizer = named
    given = dict(vars(ns))  # before the recipe: what the user said, not what it implies
    # The chosen algorithm's recipe fills options the user left out (BMUF: BMUF-Adam).
    algo = getattr(ns, "algo", TrainConfig.algo)
    if algo in algorithms.names() and named != "none":
        try:
            recipe = algorithms.get(algo).Options.recipe(vars(ns))
        except ConfigError as err:
            parser.error(str(err))
        for name, value in recipe.items():
            setattr(ns, name, value)
    try:
        cfg = from_namespace(RunConfig, ns)
    except ConfigError as err:
        parser.error(str(err))
    # A resume runs its run's algorithm: checked against that (resume_config), not the
    # default --algo, unless --algo is given.
    if not cfg.checkpoint.resume or "algo" in given:
        try:
            check_read(cfg.train.algo, given)
            cfg.algo_options().check_read(typed)
        except ConfigError as err:
            parser.error(str(err))
    cfg._given = given  # type: ignore[attr-defined]
    cfg._typed = typed  # type: ignore[attr-defined]
    if show:
        print(json.dumps(to_dict(cfg), indent=2))
        raise SystemExit(0)
    return cfg


@functools.cache  # read-only; typing.get_type_hints is most of a parse's time
def _option_types(cls: type) -> dict[str, Any]:
    """Every option's field name and type, through the nested sections."""
    hints = get_type_hints(cls)
    types_: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            types_.update(_option_types(hints[f.name]))
        else:
            types_[f.name] = hints[f.name]
    return types_


@functools.cache
def _option_sections(cls: type) -> dict[str, str]:
    """Every option's field name and the section of ``config.json`` that holds it."""
    hints = get_type_hints(cls)
    return {name: sec.name for sec in dataclasses.fields(cls)
            for name in _option_types(hints[sec.name])}
