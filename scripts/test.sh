#!/usr/bin/env bash
# README command 2: set up ./.venv (first time only) and run the whole test suite: unit tests,
# multi-rank tests under real mpirun on CPU, and GPU tests (skipped without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not mpi"`. The lab's and the
# benchmarks' own tests (tests/lab, marked `lab`) run apart: `bash scripts/test.sh tests/lab`
# (CI runs them after the suite); they are left out unless an argument names tests/lab.
# HADPSGD_MPI=mpich uses ./.venv-mpich (the mpich wheel) instead: the multi-rank tests under
# MPICH are `HADPSGD_MPI=mpich bash scripts/test.sh tests/mpi`.
#
# Without arguments the unit tests (no launches, CPU-bound) run beside the multi-rank ones at
# nice 19: the launched ranks wait on one another much of the time and leave a core idle, which
# the unit tests fill, while at that priority they take almost nothing from a rank that runs
# (so no deadline of a multi-rank test comes closer). Each half prints its own report (the
# unit tests' after the other's); the command fails if either does.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$root"
apart=(--ignore=tests/lab)
for arg in "$@"; do
  case $arg in tests/lab*) apart=() ;; esac
done
pytest=("$venv/bin/python" -m pytest -ra --durations=25)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "${apart[@]}" "$@"
fi
unit_log="$(mktemp "${TMPDIR:-/tmp}/hadpsgd-unit-tests.XXXXXX")"
trap 'rm -f "$unit_log"' EXIT
nice -n 19 "${pytest[@]}" -p no:cacheprovider tests/unit > "$unit_log" 2>&1 &
unit=$!
status=0
"${pytest[@]}" "${apart[@]}" --ignore=tests/unit || status=$?
unit_status=0
wait "$unit" || unit_status=$?
echo "================ the unit tests (tests/unit, run beside the others at nice 19) ================"
cat "$unit_log"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$unit_status"
