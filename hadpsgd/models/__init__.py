"""Acoustic models: the SWB BLSTM and its size presets."""

from hadpsgd.models.blstm import BLSTM
from hadpsgd.models.lstm import AutocastLSTM, cast_lstm
from hadpsgd.models.presets import PRESETS, Preset, build_model, count_parameters

__all__ = ["BLSTM", "PRESETS", "AutocastLSTM", "Preset", "build_model", "cast_lstm",
           "count_parameters"]
