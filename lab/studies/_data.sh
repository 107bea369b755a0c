# Sourced by the study scripts: sets TRAIN and HELDOUT.
#
#   study_data DATA_DIR TRAIN_UTTS HELDOUT_UTTS
#
# Keeps TRAIN/HELDOUT from the environment when the user gave their own HDF5 files; otherwise
# generates (once) an SWB-shaped synthetic set in DATA_DIR: 21-frame sub-sequences of
# per-utterance normalised features, but 40-dim and 32 classes so a tiny BLSTM learns it on CPU.
study_data() {
  local dir=$1 train_utts=$2 heldout_utts=$3
  if [[ -n "${TRAIN:-}" ]]; then
    : "${HELDOUT:?set HELDOUT too when TRAIN is given}"
    return
  fi
  if [[ ! -f "$dir/train.h5" ]]; then
    "${PY:-python}" -m hadpsgd.data.synth --out "$dir" --feat-dim 40 --num-classes 32 \
      --train-utts "$train_utts" --heldout-utts "$heldout_utts"
  fi
  TRAIN=$dir/train.h5
  HELDOUT=$dir/heldout.h5
}
