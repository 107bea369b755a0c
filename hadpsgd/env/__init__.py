"""``hadpsgd.env``: every ``HADPSGD_*`` environment variable the package reads, parsed in one place.

======================  ==========  ================  ==============================================
variable                type        default           meaning
======================  ==========  ================  ==============================================
HADPSGD_TIMEOUT         float > 0   300               deadline in seconds of every blocking
                                                      communication, at most 2592000 (30
                                                      days; ``inf``: none)
HADPSGD_START_TIMEOUT   float > 0   HADPSGD_TIMEOUT   deadline in seconds of MPI's start-up
                                                      (``MPI_Init`` and the ranks' first
                                                      contact, which wait for every rank's
                                                      imports and launch: a shared file
                                                      system, a busy machine), at most 2592000
                                                      (``inf``: none)
HADPSGD_RANKS_PER_NODE  int >= 1    the real nodes    emulate nodes of this many consecutive ranks
                                                      (same as ``--ranks-per-node``)
HADPSGD_INTRA_BACKEND   choice      auto              intra-node backend (``auto``, ``mpi``,
                                                      ``gloo`` or ``nccl``) when the flag
                                                      ``--intra-backend`` is ``auto``
HADPSGD_BUCKET_MB       float > 0   64                bucket size in MiB of large reductions when
                                                      not given to ``init``
HADPSGD_PIPELINE_MB     float >= 0  0 (off)           piece size in MiB of a pipelined hierarchical
                                                      gradient mean (a piece's inter-node
                                                      allreduce runs beside the next pieces'
                                                      intra-node phases; host or device
                                                      tensors), e.g. 4;
                                                      ``0``: the phases one after another
                                                      (:mod:`hadpsgd.comm.pipeline`)
HADPSGD_CUDA_AWARE      0 or 1      ask the library   declare the MPI library CUDA-aware (``1``) or
                                                      not (``0``)
HADPSGD_HOST_LINK       bool        on                NCCL between super-learners that share a
                                                      host (``0``: MPI between every two;
                                                      :mod:`hadpsgd.comm.hostlink`)
HADPSGD_SHARE_GPU       int >= 0    0 (off)           tests on one GPU: the ranks that share it run
                                                      as GPUs of their own on this many pretend
                                                      hosts, NCCL over sockets on loopback; timings
                                                      mean nothing (:mod:`hadpsgd.comm.share_gpu`)
HADPSGD_CACHE           directory   ~/.cache/hadpsgd  where the synthetic default data set is cached
HADPSGD_DEBUG           bool        off               print full tracebacks for user errors too
                                                      (``1``/``true``/``yes``/``on`` or
                                                      ``0``/``false``/``no``/``off``)
HADPSGD_FAULT           fault spec  none              fault injection, e.g.
                                                      ``kind=hang,rank=1,step=5`` (grammar:
                                                      :mod:`hadpsgd.faults`)
HADPSGD_TRACE_CHUNKS    directory   no trace          where every rank logs the chunk indices of
                                                      each step
HADPSGD_EMULATE_STEP    step spec   none              a fixed wait before every training forward,
                                                      e.g. ``ms=40,rank=1,factor=2`` (rank 1 twice
                                                      as slow): an emulated device step for
                                                      benchmarks on shared cores
HADPSGD_FT_DETECTOR     bool        off               under ``--on-failure continue``, have
                                                      ``python -m hadpsgd.launch`` turn on Open
                                                      MPI's heartbeat detector (a frozen learner
                                                      is dropped in ~2 s, not at the deadline;
                                                      crashes ~1 in 7 launches in MPI_Init on a
                                                      loaded machine: docs/failures.md)
HADPSGD_FROZEN_S        float >= 0  5                 under ``--on-failure continue``, a learner
                                                      stopped (SIGSTOP) this many seconds is
                                                      killed by a learner on its host, so that
                                                      the others go on (``0``: only at the
                                                      deadline; :mod:`hadpsgd.comm.sentinel`)
HADPSGD_STDOUT_TTY      0 or 1      ask stdout        whether the console the run's output goes to
                                                      is a terminal (progress bar) or not (plain
                                                      lines); set by ``python -m hadpsgd.launch``,
                                                      whose ranks' stdout is mpirun's pty
======================  ==========  ================  ==============================================

The "Environment variables" table of docs/usage.md lists the same variables. A variable set to the
empty string (or only blanks) counts as unset. Every bad value raises :class:`EnvError`, whose
message names the variable, the value and what to set instead.

This is the lowest layer of the package: it imports nothing from the rest of ``hadpsgd``, so
that ``comm``, ``faults``, ``data`` and ``train`` can all read their settings through it.
Values are read at every call, not cached: tests and launchers change the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

TIMEOUT = "HADPSGD_TIMEOUT"
START_TIMEOUT = "HADPSGD_START_TIMEOUT"
RANKS_PER_NODE = "HADPSGD_RANKS_PER_NODE"
INTRA_BACKEND = "HADPSGD_INTRA_BACKEND"
BUCKET_MB = "HADPSGD_BUCKET_MB"
PIPELINE_MB = "HADPSGD_PIPELINE_MB"
CUDA_AWARE = "HADPSGD_CUDA_AWARE"
HOST_LINK = "HADPSGD_HOST_LINK"
SHARE_GPU = "HADPSGD_SHARE_GPU"
CACHE = "HADPSGD_CACHE"
DEBUG = "HADPSGD_DEBUG"
FAULT = "HADPSGD_FAULT"
TRACE_CHUNKS = "HADPSGD_TRACE_CHUNKS"
EMULATE_STEP = "HADPSGD_EMULATE_STEP"
STDOUT_TTY = "HADPSGD_STDOUT_TTY"
FT_DETECTOR = "HADPSGD_FT_DETECTOR"
FROZEN_S = "HADPSGD_FROZEN_S"

NAMES: tuple[str, ...] = (TIMEOUT, START_TIMEOUT, RANKS_PER_NODE, INTRA_BACKEND, BUCKET_MB,
                          PIPELINE_MB, CUDA_AWARE, HOST_LINK, SHARE_GPU, CACHE, DEBUG, FAULT,
                          TRACE_CHUNKS, EMULATE_STEP, STDOUT_TTY, FT_DETECTOR, FROZEN_S)
"""Every variable of the table above."""

DEFAULT_TIMEOUT_S = 300.0
"""Deadline in seconds when ``HADPSGD_TIMEOUT`` is not set."""
MAX_TIMEOUT_S = 30 * 86_400.0
"""The longest finite ``HADPSGD_TIMEOUT``: 30 days. A longer one is as good as none, and past
what a thread's wait or a ``timedelta`` can hold (``1e12`` crashed start-up with an
``OverflowError``); ``inf`` says "no deadline" in so many words."""
DEFAULT_FROZEN_S = 5.0
"""How long a learner may stay stopped before its host's learners kill it (``--on-failure
continue``): torchft declares a dead replica after 5 s too. Far below the deadline slow
collectives need, and a stopped process is no slow one."""
DEFAULT_BUCKET_MB = 64.0
"""Bucket size in MiB when neither ``bucket_mb`` nor ``HADPSGD_BUCKET_MB`` is given."""
DEFAULT_PIPELINE_MB = 0.0
"""``HADPSGD_PIPELINE_MB`` when unset: no pipeline (it measured no faster on shared cores:
docs/benchmarks.md, *Pipelined hierarchical mean*)."""
INTRA_BACKEND_CHOICES: tuple[str, ...] = ("auto", "mpi", "gloo", "nccl")
"""Values of ``HADPSGD_INTRA_BACKEND`` (the same as ``--intra-backend``)."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A ``HADPSGD_*`` environment variable has a value that cannot be used.

    A :class:`ValueError`, so callers that already treat ``ValueError`` as a user's mistake
    keep doing so.
    """


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of variable ``name`` without surrounding blanks; ``None`` when unset or blank.

    Blank counts as unset so that ``VAR= cmd`` in a shell (or a launcher forwarding an empty
    value) means the default rather than an error.

    Args:
        name: The variable.
        environ: The environment to read (default this process's).
    """
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or None


def _number(name: str, kind: type[int] | type[float], hint: str, *, above: float | None = None,
            at_least: float | None = None, finite: bool = False) -> int | float | None:
    """Variable ``name`` as a number of ``kind`` in range, or ``None`` when unset.

    Args:
        name: The variable.
        kind: ``int`` or ``float``.
        hint: What to do instead, for the error messages (``set it to ..., or unset it``).
        above: The value must be greater than this.
        at_least: The value must be at least this.
        finite: Refuse infinity too.

    Raises:
        EnvError: If it is set but is no such number; the message names the variable and
            ends in ``hint``.
    """
    value = raw(name)
    if value is None:
        return None
    try:
        number = kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise EnvError(f"{name}={value!r} is not {what}; {hint}") from None
    # NaN passes neither "> x" nor "<= x": it would silently disable every comparison.
    bad = math.isnan(number) or (finite and math.isinf(number))
    bad = bad or (above is not None and number <= above)
    bad = bad or (at_least is not None and number < at_least)
    if bad:
        rule = f"> {above:g}" if above is not None else f">= {at_least:g}"
        raise EnvError(f"{name}={value!r} must be {'a finite number ' if finite else ''}{rule}; "
                       f"{hint}")
    return number


def _positive_float(name: str, default: float, example: str) -> float:
    """Variable ``name`` as a number > 0 (``default`` when unset).

    Args:
        name: The variable.
        default: Its value when unset.
        example: What to set instead, for the error messages (e.g. ``"a deadline in seconds,
            e.g. 300"``).

    Raises:
        EnvError: If it is set but is not a number > 0.
    """
    number = _number(name, float, f"set it to {example}, or unset it (default {default:g})",
                     above=0)
    return default if number is None else float(number)


def _directory(name: str) -> Path | None:
    """Variable ``name`` as a directory path (``~`` expanded); ``None`` when unset.

    The directory need not exist yet (its users create it), but a path that exists and is not
    a directory can never work: better to say so here than fail later in ``mkdir`` or with a
    confusing ``NotADirectoryError`` deep inside a writer.

    Raises:
        EnvError: If the path exists and is not a directory.
    """
    value = raw(name)
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise EnvError(f"{name}={value!r} is a file, not a directory; set it to a directory "
                       "(it is created if missing), or unset it")
    return path


def timeout() -> float:
    """``HADPSGD_TIMEOUT``: the deadline in seconds of every blocking communication.

    Returns:
        The deadline (default :data:`DEFAULT_TIMEOUT_S`); ``inf`` is allowed (no deadline).

    Raises:
        EnvError: If it is set but is not a number > 0 and at most :data:`MAX_TIMEOUT_S`
            (or ``inf``).
    """
    hint = (f"set it to a deadline in seconds, > 0 and at most {MAX_TIMEOUT_S:.0f} (30 days), "
            f"e.g. 300, or to inf for none, or unset it (default {DEFAULT_TIMEOUT_S:g})")
    number = _deadline(TIMEOUT, hint)
    return DEFAULT_TIMEOUT_S if number is None else number


def _deadline(name: str, hint: str) -> float | None:
    """Variable ``name`` as a deadline in seconds, or ``None`` when unset.

    Raises:
        EnvError: Unless it is > 0 and at most :data:`MAX_TIMEOUT_S` (or ``inf``); the
            message ends in ``hint``.
    """
    number = _number(name, float, hint, above=0)
    if number is None:
        return None
    if math.isfinite(number) and number > MAX_TIMEOUT_S:
        raise EnvError(f"{name}={raw(name)!r} is too long; {hint}")
    return float(number)


def start_timeout() -> tuple[float, str]:
    """``HADPSGD_START_TIMEOUT``: the deadline of MPI's start-up, and the variable that set it.

    ``MPI_Init`` and the ranks' first contact after it (:func:`hadpsgd.comm.init`: where
    ``MPI_Init`` does not wait for every rank, as MPICH's, the wait is there) wait for every
    rank of the launch, so a rank still importing (a shared file system at scale, a machine
    busy with other jobs) counts against them; a training run's tight ``HADPSGD_TIMEOUT``
    need not bound that. Unset, the start-up takes
    ``HADPSGD_TIMEOUT`` (:func:`timeout`), as every deadline does.

    Returns:
        ``(seconds, name)``: the deadline (``inf``: none) and the variable it came from, for
        the message that names it.

    Raises:
        EnvError: If the variable in effect is set but is not a number > 0 and at most
            :data:`MAX_TIMEOUT_S` (or ``inf``).
    """
    hint = (f"set it to the deadline of MPI's start-up in seconds, > 0 and at most "
            f"{MAX_TIMEOUT_S:.0f}, e.g. 120, or to inf for none, or unset it (then "
            f"{TIMEOUT} bounds the start-up too)")
    number = _deadline(START_TIMEOUT, hint)
    return (timeout(), TIMEOUT) if number is None else (number, START_TIMEOUT)


def bucket_mb() -> float:
    """``HADPSGD_BUCKET_MB``: the bucket size in MiB of large reductions.

    Returns:
        The size (default :data:`DEFAULT_BUCKET_MB`).

    Raises:
        EnvError: If it is set but is not a number > 0.
    """
    return _positive_float(BUCKET_MB, DEFAULT_BUCKET_MB, "a size in MiB, e.g. 64")


def pipeline_mb() -> float:
    """``HADPSGD_PIPELINE_MB``: piece size in MiB of the pipelined hierarchical gradient mean.

    Returns:
        The size (default :data:`DEFAULT_PIPELINE_MB`); 0: no pipeline.

    Raises:
        EnvError: If it is set but is not a number >= 0.
    """
    number = _number(PIPELINE_MB, float, "set it to a piece size in MiB, e.g. 4, or 0 to run the "
                     "phases one after another, or unset it (default 0)", at_least=0,
                     finite=True)
    return DEFAULT_PIPELINE_MB if number is None else float(number)


def ranks_per_node() -> int | None:
    """``HADPSGD_RANKS_PER_NODE``: emulate nodes of this many consecutive ranks.

    Returns:
        The number of ranks per emulated node, or ``None`` when unset (the real nodes).

    Raises:
        EnvError: If it is set but is not an integer >= 1.
    """
    number = _number(RANKS_PER_NODE, int, "set it to the number of consecutive ranks that form "
                     "one emulated node, or unset it", at_least=1)
    return None if number is None else int(number)


def intra_backend() -> str:
    """``HADPSGD_INTRA_BACKEND``: the intra-node backend used when ``--intra-backend auto``.

    Returns:
        One of :data:`INTRA_BACKEND_CHOICES` (default ``auto``).

    Raises:
        EnvError: If it is set to anything else.
    """
    value = raw(INTRA_BACKEND)
    if value is None:
        return "auto"
    if value not in INTRA_BACKEND_CHOICES:
        raise EnvError(f"{INTRA_BACKEND}={value!r} is unknown; choose one of "
                       f"{', '.join(INTRA_BACKEND_CHOICES)}, or unset it")
    return value


def cuda_aware() -> bool | None:
    """``HADPSGD_CUDA_AWARE``: whether the MPI library accepts CUDA device pointers.

    Returns:
        ``True`` for ``1``, ``False`` for ``0``, ``None`` when unset (ask the library).

    Raises:
        EnvError: If it is set to anything else: a typo such as ``yes`` must not silently
            fall back to asking the library, the very thing the variable overrides.
    """
    value = raw(CUDA_AWARE)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise EnvError(f"{CUDA_AWARE}={value!r} is neither 0 nor 1; set 1 if the MPI library "
                       "is CUDA-aware, 0 if not, or unset it to ask the library")
    return value == "1"


def host_link() -> bool:
    """``HADPSGD_HOST_LINK``: NCCL between super-learners that share a host.

    Returns:
        Whether it may be built (default on; ``0`` keeps those exchanges on MPI, the route
        before it: a switch for comparing the two, or for a node where it misbehaves).

    Raises:
        EnvError: If it is set to something that is neither a yes nor a no.
    """
    if raw(HOST_LINK) is None:
        return True
    return _on_off(HOST_LINK, "set it to 0 to keep exchanges between super-learners on MPI, "
                   "1 or unset it for NCCL where they share a host")


def share_gpu() -> int:
    """``HADPSGD_SHARE_GPU``: run ranks that share one GPU as GPUs of their own (tests).

    Returns:
        The pretend hosts the ranks are cut into (consecutive ranks); 0 (default): off.

    Raises:
        EnvError: If it is set but is not an integer >= 0.
    """
    number = _number(SHARE_GPU, int, "set it to the number of pretend hosts (e.g. 1 or 2) to "
                     "test NCCL between ranks on one GPU, or 0 / unset it", at_least=0)
    return 0 if number is None else int(number)


def cache_dir() -> Path:
    """``HADPSGD_CACHE``: where the synthetic default data set is cached.

    Returns:
        The directory (default ``~/.cache/hadpsgd``), which may not exist yet.

    Raises:
        EnvError: If it names something that exists and is not a directory.
    """
    return _directory(CACHE) or Path.home() / ".cache" / "hadpsgd"


def debug() -> bool:
    """``HADPSGD_DEBUG``: print full tracebacks for user errors too.

    Returns:
        Whether it is on (default off).

    Raises:
        EnvError: If it is set to something that is neither a yes nor a no (``1``, ``true``,
            ``yes``, ``on`` / ``0``, ``false``, ``no``, ``off``, any case): ``0`` must not
            mean "on", as any non-empty value once did.
    """
    return _on_off(DEBUG, "set it to 1 for full tracebacks, 0 or unset it for one-line errors")


def ft_detector(environ: Mapping[str, str] | None = None) -> bool:
    """``HADPSGD_FT_DETECTOR``: Open MPI's heartbeat detector under ``--on-failure continue``.

    Args:
        environ: The environment to read (default this process's; the launcher's children's).

    Returns:
        Whether ``python -m hadpsgd.launch`` turns it on (default off: with it, about one
        launch in seven crashed in ``MPI_Init`` on a loaded machine, docs/failures.md).

    Raises:
        EnvError: If it is set to something that is neither a yes nor a no.
    """
    return _on_off(FT_DETECTOR, "set it to 1 for the heartbeat detector, 0 or unset it for "
                                "none (a frozen learner is then found at HADPSGD_TIMEOUT)",
                   environ)


def frozen_s() -> float:
    """``HADPSGD_FROZEN_S``: seconds a learner may stay stopped before it is killed (0: off).

    Returns:
        The time (default :data:`DEFAULT_FROZEN_S`); 0 leaves a frozen learner to the
        deadline (``HADPSGD_TIMEOUT``).

    Raises:
        EnvError: If it is set but is not a finite number >= 0.
    """
    number = _number(FROZEN_S, float, "set it to seconds, e.g. 5, or 0 to leave a frozen learner "
                     f"to the deadline, or unset it (default {DEFAULT_FROZEN_S:g})",
                     at_least=0, finite=True)
    return DEFAULT_FROZEN_S if number is None else float(number)


def _on_off(name: str, fix: str, environ: Mapping[str, str] | None = None) -> bool:
    """A yes / no variable (default no); anything else is an :class:`EnvError` with ``fix``."""
    value = raw(name, environ)
    if value is None:
        return False
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise EnvError(f"{name}={value!r} is neither on nor off; {fix}")


def fault_spec() -> str:
    """``HADPSGD_FAULT``: the raw fault-injection spec (``""`` when unset).

    Its grammar belongs to :mod:`hadpsgd.faults`, whose ``parse`` raises :class:`EnvError` on
    a bad spec; this module only reads the string.
    """
    return raw(FAULT) or ""


def trace_chunks_dir() -> Path | None:
    """``HADPSGD_TRACE_CHUNKS``: where every rank logs the chunk indices of each step.

    Returns:
        The directory (created by the caller if missing), or ``None`` when unset (no trace).

    Raises:
        EnvError: If it names something that exists and is not a directory.
    """
    return _directory(TRACE_CHUNKS)


def emulated_step_s(rank: int) -> float:
    """``HADPSGD_EMULATE_STEP``: seconds this rank waits before every training forward.

    The spec is ``ms=M`` (every rank waits M milliseconds) optionally with ``rank=R`` and
    ``factor=K`` (rank R waits K times as long: a straggler). A wait, not computation, so
    that ranks sharing a few cores do not slow each other down and the benchmark measures
    the algorithm, not the machine.

    Returns:
        The wait in seconds (0 when unset).

    Raises:
        EnvError: For a malformed spec, naming the part and the grammar.
    """
    value = raw(EMULATE_STEP)
    if value is None:
        return 0.0
    grammar = "ms=M[,rank=R,factor=K], e.g. ms=40,rank=1,factor=2"
    parts: dict[str, float] = {}
    for item in value.split(","):
        key, sep, num = item.partition("=")
        key = key.strip()
        if not sep or key not in ("ms", "rank", "factor"):
            raise EnvError(f"{EMULATE_STEP}={value!r}: {item.strip()!r} is not ms=, rank= or "
                           f"factor=; set it to {grammar}, or unset it")
        try:
            parts[key] = float(num)
        except ValueError:
            raise EnvError(f"{EMULATE_STEP}={value!r}: {key}={num.strip()!r} is not a number; "
                           f"set it to {grammar}, or unset it") from None
    if "ms" not in parts or parts["ms"] < 0 or parts.get("factor", 1.0) <= 0:
        raise EnvError(f"{EMULATE_STEP}={value!r} needs ms >= 0 (and factor > 0); set it to "
                       f"{grammar}, or unset it")
    wait = parts["ms"] / 1000.0
    if "rank" in parts and int(parts["rank"]) == rank:
        wait *= parts.get("factor", 1.0)
    return wait


def stdout_tty() -> bool | None:
    """``HADPSGD_STDOUT_TTY``: whether the console the run's output reaches is a terminal.

    Open MPI hands every rank a pseudo-terminal as its stdout, so a rank cannot see that the
    user redirected ``python -m hadpsgd.launch ... > log``; the launcher, which can, says so
    here. The progress bar follows it: a bar on a terminal, plain lines in a file.

    Returns:
        ``True`` for ``1``, ``False`` for ``0``, ``None`` when unset (ask the rank's own
        stdout, as under a plain ``mpirun``).

    Raises:
        EnvError: If it is set to anything else.
    """
    value = raw(STDOUT_TTY)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise EnvError(f"{STDOUT_TTY}={value!r} is neither 0 nor 1; set 1 if the run's output "
                       "goes to a terminal (progress bar), 0 if to a file (plain lines), or "
                       "unset it to ask the process's stdout")
    return value == "1"


def check() -> None:
    """Parse every variable this module reads, so a bad one is reported before any work.

    Each reader also checks at its own call; this lets an entry point fail at start-up, as a
    user error, rather than hours into a run (a bad ``HADPSGD_DEBUG`` is otherwise only read
    while reporting another error). ``HADPSGD_FAULT``'s grammar is checked by
    :mod:`hadpsgd.faults`, not here.

    Raises:
        EnvError: For the first bad variable, in the order of the table.
    """
    timeout()
    start_timeout()
    ranks_per_node()
    intra_backend()
    bucket_mb()
    pipeline_mb()
    cuda_aware()
    host_link()
    share_gpu()
    cache_dir()
    debug()
    trace_chunks_dir()
    emulated_step_s(0)
    stdout_tty()
    ft_detector()
    frozen_s()
