"""The model to run: a checkpoint found from ``--model``, rebuilt from its own configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        """The training's ``--precision``."""
        return str(self.config.get("train", {}).get("precision", "fp32"))

    @property
    def train_file(self) -> str | None:
        """The training file the run named (None for the synthetic default set)."""
        return self.config.get("data", {}).get("train")


def find_checkpoint(spec: str | Path) -> tuple[Path, Path | None]:
    """The checkpoint ``--model`` names and its run directory (None if it is not in one).

    A run directory gives its newest valid checkpoint (checksums verified; broken ones are
    skipped by name); a checkpoint directory is taken as it is.

    Raises:
        ForwardError: If ``spec`` is neither, or the run has no valid checkpoint.
    """
    path = Path(spec)
    if not path.exists():
        raise ForwardError(f"--model {path} does not exist; pass a run directory (the "
                           "--out-dir of a training) or one of its checkpoints/step-NNNNNNNN")
    if (path / STATE_FILE).is_file():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return path, run_dir
    if (path / "checkpoints").is_dir():
        skipped: list[str] = []
        found = latest_checkpoint(path / "checkpoints", report=skipped.append)
        if found is None:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise ForwardError(f"--model {path}: the run has no valid checkpoint in "
                               f"{path / 'checkpoints'}{why}; train it (or resume it) to a "
                               "checkpoint first, or pass another run")
        return found, path
    raise ForwardError(f"--model {path} is neither a run directory (with checkpoints/) nor a "
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


def load_model(spec: str | Path) -> LoadedModel:
    """Load the model ``--model`` names, built from the preset its configuration names.

    BMUF's checkpoints hold the global model apart from the learner's replica
    (``eval_model``, the model training evaluates): that one is used when present.

    Raises:
        ForwardError: For a missing, broken or foreign checkpoint, naming it and the fix.
    """
    path, run_dir = find_checkpoint(spec)
    try:
        state = load_checkpoint(path)
    except (CheckpointError, FileNotFoundError) as err:
        raise ForwardError(f"--model: {err}") from None
    config = state.get("config")
    if not isinstance(config, dict) or "preset" not in config.get("model", {}):
        raise ForwardError(f"checkpoint {path} has no configuration naming its model preset "
                           "(config.model.preset); it predates hadpsgd's saved configs: "
                           "retrain, or save the state with a 'config' entry")
    weights_key = "eval_model" if "eval_model" in state else "model"
    weights = state[weights_key]
    input_dim, num_classes = _shapes(weights, path)
    preset = config["model"]["preset"]
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
    model.eval()
    return LoadedModel(model, path, run_dir, config, weights_key)


def describe(loaded: LoadedModel) -> str:
    """One line: which checkpoint, which weights, the model's shape."""
    try:
        step = read_manifest(loaded.checkpoint).get("step", "?")
    except CheckpointError:
        step = "?"
    return (f"{loaded.checkpoint} (step {step}, {loaded.weights}): "
            f"{loaded.config['model']['preset']} BLSTM, {loaded.input_dim} inputs, "
            f"{loaded.num_classes} classes, trained on chunks of {loaded.chunk_len} frames")

