#!/usr/bin/env bash
# Study A: BMUF-Adam moment strategies (Table 1 of the BMUF-Adam paper) at small scale.
#
# 16 and 32 workers (one rank = one BMUF worker, as the paper treats one GPU as a worker),
# tau = 8, `corrected` vs `average` moments, beta1 0.9 vs 0.5, against a single-learner Adam
# baseline with the same per-worker batch, learning rate, schedule, data and epochs.
#
#   bash lab/studies/study_a.sh [SWEEP_DIR] [DATA_DIR]
#
# Rerunning resumes (finished cells are skipped). Pass your own HDF5 files with
# TRAIN=... HELDOUT=... in the environment instead of the synthetic set.
set -euo pipefail
SWEEP=${1:-runs/study-a}
DATA=${2:-runs/study-data}
EPOCHS=${EPOCHS:-8}
BATCH=${BATCH:-8}          # sub-sequences per worker per step
LR=${LR:-0.003}            # Adam rate of the baseline, used unchanged by BMUF (as the paper does)
PY=${PYTHON:-python}

# 2000 training utterances: ~400k frames, 18,255 chunks.
source "$(dirname "$0")/_data.sh"
study_data "$DATA" 2000 100

common=(--preset tiny --epochs "$EPOCHS" --timeout 1800)
pass=(--train "$TRAIN" --heldout "$HELDOUT" --lr "$LR" --base-batch "$BATCH"
      --warmup-epochs 0 --keep-checkpoints 1 --log-every 50)

# Baseline: one learner, Adam, beta1 0.9.
"$PY" -m lab.sweep --sweep-dir "$SWEEP" "${common[@]}" --algos ssgd --learners 1 \
  --global-batch "$BATCH" --optimizer adam --beta1 0.9 -- "${pass[@]}"

# BMUF-Adam. The paper warms up on 10 % of the training samples; here that is synchronous
# Adam over all workers for 10 % of one epoch's steps (the data's 21-frame chunks / global
# batch / 10: 14 steps for 16 workers and 7 for 32 on the synthetic set).
chunks=$("$PY" -c 'import sys, h5py
from hadpsgd.data.sampler import chunk_starts
with h5py.File(sys.argv[1], "r") as f:
    print(len(chunk_starts(f["offsets"][:], 21)))' "$TRAIN")
for L in 16 32; do
  warm=$(( chunks / (L * BATCH) / 10 ))
  "$PY" -m lab.sweep --sweep-dir "$SWEEP" "${common[@]}" --algos bmuf --learners "$L" \
    --global-batch $(( L * BATCH )) --ranks-per-node 1 --sync-period 8 \
    --adam-moments corrected,average --beta1 0.9,0.5 \
    -- "${pass[@]}" --bmuf-warmup-steps "$warm"
done
