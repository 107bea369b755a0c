"""Local launch helpers: find the venv's ``mpirun`` and start N ranks of a script or module."""

from hadpsgd.launch.mpirun import (
    Launcher,
    LauncherError,
    find_launcher,
    launch_env,
    mpirun_command,
)

__all__ = ["Launcher", "LauncherError", "find_launcher", "launch_env", "mpirun_command"]
