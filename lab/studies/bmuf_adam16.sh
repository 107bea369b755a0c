#!/usr/bin/env bash
# Issue 46, study B: BMUF-Adam at 16 workers against the single learner with Adam, on unseen
# human voices, with enough steps for the paper's claim to live (ICASSP 2020, BMUF-Adam).
#
# Data: FSDD folds built with Kaldi's 3-way speed perturbation of the training speakers
# (examples/digits/fsdd.py --speed-perturb 0.9,1.0,1.1: 6,000 training utterances, ~250k
# frames, ~15k chunks of 21 frames on fold A), the held-out speakers never heard:
#
#   for f in A C D; do python examples/digits/fsdd.py RECORDINGS $FSDD/sp$f --fold $f \
#       --speed-perturb 0.9,1.0,1.1; done
#
# Per worker 4 chunks a step (the global batch 64 at 16 workers): 232 steps an epoch on fold A,
# so EPOCHS=8 gives 1,856 steps, ~229 block syncs at tau 8. The single learner takes the same
# per-worker batch and epochs (the paper's baseline: one GPU, the same minibatch), so every
# worker of BMUF-Adam steps at the single learner's rate (--bmuf-worker-lr single).
# Warm-up as the paper's: the run starts with WARMUP_STEPS synchronous steps (10 % of an
# epoch's data at 16 workers) before the first block (--bmuf-warmup-steps).
#
#   FSDD=/tmp/fsdd bash lab/studies/bmuf_adam16.sh [SWEEP_ROOT]
#   python -m lab.studies.scale_wer SWEEP_ROOT          # the table, claim by claim
#
# Each configuration runs over the folds before the next starts (most telling first), each
# fold its own lab.sweep directory (SWEEP_ROOT/fold$f); rerunning resumes, and --wer scores
# every finished cell through hadpsgd.forward and hadpsgd.decode. CONFIGS picks a subset.
set -euo pipefail
ROOT=${1:-runs/bmuf-adam16}
FSDD=${FSDD:?set FSDD to the folder holding spA, spC, spD}
EPOCHS=${EPOCHS:-8}
FOLDS=${FOLDS:-A C D}
SEEDS=${SEEDS:-0}
WORKERS=${WORKERS:-16}  # BMUF-Adam's workers (and SSGD's learners); 4 chunks each a step
BATCH=$((4 * WORKERS))
WARMUP_STEPS=${WARMUP_STEPS:-$((1600 / BATCH))}  # 1,600 chunks of warm-up at any WORKERS
CONFIGS=${CONFIGS:-paper single ssgd average beta09 tau16}
PY=${PYTHON:-python}

run() {  # run FOLD SWEEP-ARGS... -- RUN-ARGS...
  local fold=$1; shift
  "$PY" -m lab.sweep --sweep-dir "$ROOT/fold$fold" --wer --epochs "$EPOCHS" --preset small \
    --seed "${SEEDS// /,}" --timeout 1500 "$@"
}

for config in $CONFIGS; do
  for fold in $FOLDS; do
    data=(--train "$FSDD/sp$fold/train.h5" --heldout "$FSDD/sp$fold/heldout.h5"
          --keep-checkpoints 1 --log-every 50)
    bmuf=(--algos bmuf --learners "$WORKERS" --global-batch "$BATCH" --optimizer adam
          --ranks-per-node 1)
    case $config in
      paper)   # the paper's recipe: beta1 0.5, corrected moments, eta 1 - 1/16, tau 8
        run "$fold" "${bmuf[@]}" --beta1 0.5 --sync-period 8 --adam-moments corrected -- \
          "${data[@]}" --bmuf-warmup-steps "$WARMUP_STEPS" ;;
      single)  # one learner, Adam, the same per-worker batch and epochs
        run "$fold" --algos ssgd --learners 1 --global-batch 4 --optimizer adam \
          --beta1 0.9 -- "${data[@]}" ;;
      ssgd)    # SSGD with Adam at the world's batch (rate scaled linearly, warm-up 1 epoch)
        run "$fold" --algos ssgd --learners "$WORKERS" --global-batch "$BATCH" --optimizer adam \
          --beta1 0.9 --ranks-per-node 1 -- "${data[@]}" ;;
      average) # the moments averaged (Eq. 13) instead of corrected (Eq. 18)
        run "$fold" "${bmuf[@]}" --beta1 0.5 --sync-period 8 --adam-moments average -- \
          "${data[@]}" --bmuf-warmup-steps "$WARMUP_STEPS" ;;
      beta09)  # Adam's usual beta1 instead of the paper's 0.5
        run "$fold" "${bmuf[@]}" --beta1 0.9 --sync-period 8 --adam-moments corrected -- \
          "${data[@]}" --bmuf-warmup-steps "$WARMUP_STEPS" ;;
      warmworld)  # the paper's recipe, its synchronous warm-up at SSGD's rate for the world
        run "$fold" "${bmuf[@]}" --beta1 0.5 --sync-period 8 --adam-moments corrected -- \
          "${data[@]}" --bmuf-warmup-steps "$WARMUP_STEPS" --bmuf-warmup-lr world ;;
      warmworld4)  # warmworld with blocks of 4 (speechocean762 at 16 workers: tau 8 trailed SSGD)
        run "$fold" "${bmuf[@]}" --beta1 0.5 --sync-period 4 --adam-moments corrected -- \
          "${data[@]}" --bmuf-warmup-steps "$WARMUP_STEPS" --bmuf-warmup-lr world ;;
      tau16)
        run "$fold" "${bmuf[@]}" --beta1 0.5 --sync-period 16 --adam-moments corrected -- \
          "${data[@]}" --bmuf-warmup-steps "$WARMUP_STEPS" ;;
      *) echo "bmuf_adam16.sh: unknown config $config" >&2; exit 2 ;;
    esac
  done
done
