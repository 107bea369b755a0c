#!/usr/bin/env bash
# Issue 46, study A: SSGD against ADPSGD against H-ADPSGD at 16 learners across global
# batches, on unseen human voices, with the H-ADPSGD paper's recipe: SGD (momentum 0.9), the
# rate scaled linearly with the global batch (--lr 0.5 at --base-batch 128, hadpsgd.run's
# defaults), linear warm-up over the first half of the epochs (the paper: 10 of 16), then
# 1/sqrt(2) annealing a epoch. Where does each stop converging, and is ADPSGD's limit larger
# (the paper: 3x SSGD's batch at 16 learners)?
#
# Data: the speed-perturbed FSDD folds of lab/studies/bmuf_adam16.sh. 16 learners on 4
# emulated nodes of 4: SSGD averages every step over all 16 (hierarchically); flat ADPSGD
# gossips between 16 learners (--super-learner-size 1); H-ADPSGD between 4 super-learners of
# 4 (--super-learner-size 4), each averaging its gradients inside. The global batch 256 is 16
# chunks a learner (~58 steps an epoch on fold A's ~14.8k chunks), 1024 is 64 (15), 2048 is 128
# (7): 2, 8 and 16 times the --base-batch. (Steps run out before the batch does: past 2048 an 8-epoch run has fewer
# than 50 steps, too few to tell a batch that fails from a run that is short.)
#
#   FSDD=/tmp/fsdd bash lab/studies/adpsgd_batch16.sh [SWEEP_ROOT]
#   python -m lab.studies.scale_wer SWEEP_ROOT
#
# Rerunning resumes. BATCHES, FOLDS, SEEDS and EPOCHS pick the cells; LEARNERS, ALGOS and
# SUPER (super-learner sizes) the runs of each: "H-ADPSGD with super-learners of N behaves as
# ADPSGD with 1/N the learners" compares H-ADPSGD 4 x 4 with LEARNERS=4 ALGOS=adpsgd SUPER=1
# at the same global batch.
set -euo pipefail
ROOT=${1:-runs/adpsgd-batch16}
FSDD=${FSDD:?set FSDD to the folder holding spA, spC, spD}
EPOCHS=${EPOCHS:-8}
FOLDS=${FOLDS:-A}
SEEDS=${SEEDS:-0}
BATCHES=${BATCHES:-2048 1024 256}
WARMUP=${WARMUP:-$((EPOCHS / 2))}
LEARNERS=${LEARNERS:-16}
ALGOS=${ALGOS:-ssgd,adpsgd}
SUPER=${SUPER:-1,4}
PY=${PYTHON:-python}

for batch in $BATCHES; do   # the largest first: where the algorithms part is the question
  for fold in $FOLDS; do
    "$PY" -m lab.sweep --sweep-dir "$ROOT/fold$fold" --wer --epochs "$EPOCHS" --preset small \
      --seed "${SEEDS// /,}" --timeout 1500 --algos "$ALGOS" --super-learner-size "$SUPER" \
      --learners "$LEARNERS" --ranks-per-node 4 --global-batch "$batch" --optimizer sgd -- \
      --train "$FSDD/sp$fold/train.h5" --heldout "$FSDD/sp$fold/heldout.h5" \
      --warmup-epochs "$WARMUP" --keep-checkpoints 1 --log-every 50
  done
done
