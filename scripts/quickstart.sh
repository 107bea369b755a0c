#!/usr/bin/env bash
# README command 1: set up ./.venv (first time only) and train the small BLSTM with SSGD on
# 4 local MPI ranks over the synthetic SWB-shaped data (generated and cached on first use).
# Extra arguments go to hadpsgd.run, e.g. `bash scripts/quickstart.sh --epochs 2`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$root"
exec "$venv/bin/python" -m hadpsgd.launch -n "${NPROCS:-4}" -- --algo ssgd "$@"
