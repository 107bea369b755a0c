"""Acoustic models: the SWB BLSTM and its size presets."""

from hadpsgd.models.blstm import BLSTM
from hadpsgd.models.presets import PRESETS, Preset, build_model, count_parameters

__all__ = ["BLSTM", "PRESETS", "Preset", "build_model", "count_parameters"]
