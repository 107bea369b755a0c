#!/usr/bin/env bash
# README command 2: set up ./.venv (first time only) and run the whole test suite: unit tests,
# multi-rank tests under real mpirun on CPU, and GPU tests (skipped without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not mpi"`. The lab's and the
# benchmarks' own tests (tests/lab, marked `lab`) run apart: `bash scripts/test.sh tests/lab`
# (CI runs them after the suite); they are left out unless an argument names tests/lab.
# HADPSGD_MPI=mpich uses ./.venv-mpich (the mpich wheel) instead: the multi-rank tests under
# MPICH are `HADPSGD_MPI=mpich bash scripts/test.sh tests/mpi`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$root"
apart=(--ignore=tests/lab)
for arg in "$@"; do
  case $arg in tests/lab*) apart=() ;; esac
done
exec "$venv/bin/python" -m pytest -ra --durations=25 "${apart[@]}" "$@"
