#!/usr/bin/env bash
# README command 2: set up ./.venv (first time only) and run the whole test suite: unit tests,
# multi-rank tests under real mpirun on CPU, and GPU tests (skipped without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not mpi"`. The lab's and the
# benchmarks' own tests (tests/lab, marked `lab`) run apart: `bash scripts/test.sh tests/lab`
# (CI runs them after the suite); they are left out unless an argument names tests/lab.
# HADPSGD_MPI=mpich uses ./.venv-mpich (the mpich wheel) instead: the multi-rank tests under
# MPICH are `HADPSGD_MPI=mpich bash scripts/test.sh tests/mpi`.
# Tests run in HADPSGD_TEST_WORKERS pytest processes at once (pytest-xdist, whole files to a
# process, default 2; 0 runs them in this one): much of the multi-rank suite waits on
# deadlines, frozen ranks and launches with cores idle, so two processes took the suite from
# 15:22 to 10:35 on the 2-core CI machine. `-n 0` among the arguments overrides it too.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$root"
apart=(--ignore=tests/lab)
for arg in "$@"; do
  case $arg in tests/lab*) apart=() ;; esac
done
workers=(-n "${HADPSGD_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
exec "$venv/bin/python" -m pytest -ra --durations=25 "${workers[@]}" "${apart[@]}" "$@"
