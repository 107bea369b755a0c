"""The model to run: the checkpoint a command names, rebuilt from its own configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hadpsgd.data.priors import Priors
from hadpsgd.models import BLSTM, build_model
from hadpsgd.train.checkpoint import (
    STATE_FILE,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
)


class ForwardError(ValueError):
    """A user error of ``python -m hadpsgd.forward``: the message names the thing and the fix."""


@dataclass
class LoadedModel:
    """A checkpoint's deployable model and what the forward pass needs to know of its run."""

    model: BLSTM
    """The model in evaluation mode, on the CPU (the caller moves it)."""
    checkpoint: Path
    """The checkpoint directory it was loaded from."""
    run_dir: Path | None
    """The run directory holding the checkpoint (for ``RUN/priors.json``), if it is one."""
    config: dict[str, Any]
    """The run's resolved configuration, as saved in the checkpoint."""
    weights: str
    """``eval_model`` (BMUF's global model) or ``model`` (the learner's replica)."""
    averaged: tuple[Path, ...] = ()
    """The checkpoints whose weights were averaged into :attr:`model` (``--avg``,
    ``--avg-best``: :mod:`hadpsgd.forward.average`), :attr:`checkpoint` first; empty for one
    checkpoint's own weights."""
    selection: str = ""
    """How :attr:`averaged` was chosen, as a phrase (``newest 3``); empty without averaging."""
    skipped: tuple[str, ...] = ()
    """The checkpoints left out of an average because they failed verification, each with
    why."""

    @property
    def source(self) -> str:
        """What the weights are: the checkpoint, or the average and its checkpoints."""
        if not self.averaged:
            return str(self.checkpoint)
        return (f"average of {len(self.averaged)} checkpoints of {self.checkpoint.parent} "
                f"({self.selection}): {', '.join(p.name for p in self.averaged)}")

    @property
    def input_dim(self) -> int:
        """Feature dimension the model reads."""
        return self.model.input_dim

    @property
    def num_classes(self) -> int:
        """Output classes of the model."""
        return self.model.num_classes

    @property
    def chunk_len(self) -> int:
        """The training's chunk length (``config["data"]["chunk_len"]``)."""
        return int(self.config.get("data", {}).get("chunk_len", 21))

    @property
    def precision(self) -> str:
        """The training's ``--precision`` (in ``train`` where the run predates its section)."""
        for section in ("precision", "train"):
            value = (self.config.get(section) or {}).get("precision")
            if value is not None:
                return str(value)
        return "fp32"

    @property
    def train_file(self) -> str | None:
        """The training file the run named (None for the synthetic default set)."""
        return self.config.get("data", {}).get("train")


def find_checkpoint(spec: str | Path) -> tuple[Path, Path | None]:
    """The checkpoint ``spec`` names and its run directory (None if it is not in one).

    A run directory gives its newest valid checkpoint (checksums verified; broken ones are
    skipped by name); a checkpoint directory is taken as it is.

    Raises:
        ForwardError: If ``spec`` is neither, or the run has no valid checkpoint.
    """
    path = Path(spec)
    if not path.exists():
        raise ForwardError(f"the model {path} does not exist; pass a run directory (the "
                           "--out-dir of a training) or one of its checkpoints/step-NNNNNNNN")
    if (path / STATE_FILE).is_file():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return path, run_dir
    if (path / "checkpoints").is_dir():
        skipped: list[str] = []
        found = latest_checkpoint(path / "checkpoints", report=skipped.append)
        if found is None:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise ForwardError(f"the model {path}: the run has no valid checkpoint in "
                               f"{path / 'checkpoints'}{why}; train it (or resume it) to a "
                               "checkpoint first, or pass another run")
        return found, path
    raise ForwardError(f"the model {path} is neither a run directory (with checkpoints/) nor a "
                       f"checkpoint directory (with {STATE_FILE}); pass the --out-dir of a "
                       "training or one of its checkpoints/step-NNNNNNNN")


def _shapes(weights: dict[str, Any], where: Path) -> tuple[int, int]:
    """Input dimension and class count of a BLSTM state dict (first LSTM and output layer)."""
    try:
        return int(weights["lstm.weight_ih_l0"].shape[1]), int(weights["out.weight"].shape[0])
    except (KeyError, AttributeError, IndexError):
        raise ForwardError(f"checkpoint {where} does not hold a hadpsgd BLSTM (no "
                           "lstm.weight_ih_l0 / out.weight); pass a checkpoint of "
                           "python -m hadpsgd.run") from None


def read_state(path: Path, verify: bool = True) -> dict[str, Any]:
    """The state of checkpoint ``path`` (:func:`~hadpsgd.train.checkpoint.load_checkpoint`).

    Raises:
        ForwardError: For a missing, broken or foreign checkpoint, naming it.
    """
    try:
        return load_checkpoint(path, verify=verify)
    except (CheckpointError, FileNotFoundError) as err:
        raise ForwardError(f"the model: {err}") from None


def deployable(state: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """A checkpoint state's deployable weights, its run's configuration and the weights' key.

    BMUF's checkpoints hold the global model apart from the learner's replica
    (``eval_model``, the model training evaluates): that one is used when present.

    Raises:
        ForwardError: If the state names no model preset.
    """
    config = state.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or "preset" not in model:
        raise ForwardError(f"checkpoint {path} has no configuration naming its model preset "
                           "(config.model.preset); it predates hadpsgd's saved configs: "
                           "retrain, or save the state with a 'config' entry")
    _check_config(config, path)
    key = "eval_model" if "eval_model" in state else "model"
    weights = state[key]
    if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        what = "a dict holding other things than tensors" if isinstance(weights, dict) else \
            f"a {type(weights).__name__}"
        raise ForwardError(f"checkpoint {path}: its {key!r} entry is {what}, not a state dict "
                           "of named tensors; pass a checkpoint of python -m hadpsgd.run")
    return weights, config, key


def _check_config(config: dict[str, Any], path: Path) -> None:
    """Refuse a saved configuration whose entries forward reads have the wrong types.

    A checkpoint edited or written by another tool would otherwise fail later with a bare
    ``AttributeError`` or ``TypeError`` and no name.

    Raises:
        ForwardError: Naming the entry, what it holds, and the fix.
    """
    def bad(entry: str, value: Any, want: str) -> ForwardError:
        return ForwardError(f"checkpoint {path}: config.{entry} is {value!r}, not {want}; the "
                            "checkpoint's saved configuration is damaged: pass another "
                            "checkpoint, or fix that entry in its state")

    for section in ("data", "train"):
        if not isinstance(config.get(section, {}), dict):
            raise bad(section, config[section], "a section (a JSON object)")
    data = config.get("data", {})
    chunk = data.get("chunk_len", 21)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise bad("data.chunk_len", chunk, "a whole number >= 1")
    train = data.get("train")
    if train is not None and not isinstance(train, str):
        raise bad("data.train", train, "a path or null")
    if not isinstance(config["model"]["preset"], str):
        raise bad("model.preset", config["model"]["preset"], "a preset name")


def build(weights: dict[str, Any], config: dict[str, Any], path: Path) -> BLSTM:
    """The BLSTM of ``config``'s preset holding ``weights``, in evaluation mode, on the CPU.

    Raises:
        ForwardError: If the weights do not fit the preset (naming the checkpoint ``path``).
    """
    input_dim, num_classes = _shapes(weights, path)
    preset = config["model"]["preset"]
    bad = [name for name, value in weights.items() if isinstance(value, torch.Tensor)
           and value.is_floating_point() and not bool(torch.isfinite(value).all())]
    if bad:
        # A diverged model's scores are NaN: refused here, not found by the decoder later.
        raise ForwardError(f"checkpoint {path} holds non-finite weights ({', '.join(bad[:3])}"
                           f"{', ...' if len(bad) > 3 else ''}): the run diverged before it "
                           "was written; pass an earlier checkpoint of the run")
    try:
        # Stacked layout: the checkpoint's names, and cuDNN's fused multi-layer LSTM is the
        # faster one when nothing needs gradients layer by layer.
        model = build_model(preset, input_dim, num_classes, per_layer=False)
        model.load_state_dict(weights)
    except (ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0]
        raise ForwardError(f"checkpoint {path} does not fit a {preset!r} BLSTM with "
                           f"{input_dim} inputs and {num_classes} classes ({first}); the "
                           "checkpoint's config and weights disagree") from None
    return model.eval()


def load_model(spec: str | Path) -> LoadedModel:
    """Load the model ``spec`` names, built from the preset its configuration names.

    BMUF's checkpoints hold the global model apart from the learner's replica
    (``eval_model``, the model training evaluates): that one is used when present.

    Raises:
        ForwardError: For a missing, broken or foreign checkpoint, naming it and the fix.
    """
    path, run_dir = find_checkpoint(spec)
    weights, config, key = deployable(read_state(path), path)
    return LoadedModel(build(weights, config, path), path, run_dir, config, key)


def check_priors(loaded: LoadedModel, priors: Priors | None) -> None:
    """Refuse priors of another class count than the model's output, naming the file passed.

    Raises:
        ForwardError: If they differ, naming the checkpoint, the priors' file (and the
            training file they were counted from) and the fix.
    """
    if priors is not None and priors.num_classes != loaded.num_classes:
        raise ForwardError(
            f"class count mismatch: checkpoint {loaded.checkpoint} has {loaded.num_classes} "
            f"output classes but the priors {priors.describe()} have {priors.num_classes}; "
            "pass the priors of its own run (--priors auto) or --priors none")


def describe(loaded: LoadedModel) -> str:
    """One line: which checkpoint (or average), which weights, the model's shape."""
    try:
        step = read_manifest(loaded.checkpoint).get("step", "?")
    except CheckpointError:
        step = "?"
    shape = (f"{loaded.config['model']['preset']} BLSTM, {loaded.input_dim} inputs, "
             f"{loaded.num_classes} classes, trained on chunks of {loaded.chunk_len} frames")
    skipped = "".join(f"; {why}" for why in loaded.skipped)
    if loaded.averaged:
        return f"{loaded.source} ({loaded.weights}): {shape}{skipped}"
    return f"{loaded.checkpoint} (step {step}, {loaded.weights}): {shape}"

