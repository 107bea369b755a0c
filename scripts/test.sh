#!/usr/bin/env bash
# README command 2: set up ./.venv (first time only) and run the whole test suite: unit tests,
# multi-rank tests under real mpirun on CPU, and GPU tests (skipped without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not mpi"`.
# HADPSGD_MPI=mpich uses ./.venv-mpich (the mpich wheel) instead: the multi-rank tests under
# MPICH are `HADPSGD_MPI=mpich bash scripts/test.sh tests/mpi`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$root"
exec "$venv/bin/python" -m pytest -ra --durations=25 "$@"
