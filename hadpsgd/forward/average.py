"""Checkpoint averaging: one model from the mean weights of several checkpoints of a run.

The newest N (``--avg N``, icefall's ``--avg``) or the N of lowest held-out loss
(``--avg-best N``, ESPnet's ``ave_Nbest``) complete checkpoints of a run directory are
averaged parameter by parameter. A checkpoint that fails verification (its manifest's sizes
and SHA-256 sums) is skipped by name, as ``--resume auto`` skips it. Each checkpoint gives
its deployable weights (BMUF's global model where it has one, as
:func:`hadpsgd.forward.model.load_model` takes them), and all of them must be the same
architecture: the same preset, the same parameter names and shapes.

A checkpoint's held-out loss is the evaluation its manifest records (``heldout``: written
with the checkpoint of an epoch's end, :mod:`hadpsgd.train.best`), or for a run written before
manifests held it, the ``eval`` record of its step in the run's ``metrics.jsonl`` (after a
resume the records of steps trained twice follow the first ones: the last record of a step
counts). Checkpoints of steps that were never evaluated (``--checkpoint-every``, a stop by
signal) have none and are not candidates of ``--avg-best``.

Named with a checkpoint directory (``RUN/checkpoints/step-NNNNNNNN``) instead of the run,
the candidates are that checkpoint and the older ones beside it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from hadpsgd.forward.model import (
    ForwardError,
    LoadedModel,
    build,
    deployable,
    find_checkpoint,
    load_model,
    read_state,
)
from hadpsgd.train.best import heldout_loss
from hadpsgd.train.checkpoint import (
    STATE_FILE,
    CheckpointError,
    list_checkpoints,
    verify_checkpoint,
)
from hadpsgd.train.metrics import read_metrics

METRICS_FILE = "metrics.jsonl"
"""The run's metrics, whose ``eval`` records hold each evaluated step's held-out loss."""


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--avg N`` and ``--avg-best N`` (one or the other) to a command line."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--avg", type=_count, default=0, metavar="N",
                       help="average the weights of the newest N complete checkpoints of the "
                            "run (ending at the checkpoint named, if one is); a run keeps "
                            "--keep-checkpoints of them (3 by default)")
    group.add_argument("--avg-best", type=_count, default=0, metavar="N",
                       help="average the weights of the N complete checkpoints of lowest "
                            "held-out loss (recorded in their manifests, or in the run's "
                            "metrics.jsonl); a run keeps --keep-best of them beside the newest")


def _step(path: Path) -> int:
    """The global step in a checkpoint's name (``step-00000125``)."""
    return int(path.name.split("-", 1)[1])


Found = list[tuple[Path, dict[str, Any]]]
"""Verified checkpoints and their manifests, newest first."""


def complete_checkpoints(spec: str | Path) -> tuple[Found, Path | None, list[str]]:
    """The complete, verified checkpoints the model offers, newest first.

    Returns:
        ``(checkpoints and manifests, run directory or None, skipped)``: ``skipped`` names
        each checkpoint that failed verification and why.

    Raises:
        ForwardError: If ``spec`` names nothing usable, or a checkpoint that is itself broken.
    """
    path = Path(spec)
    if (path / STATE_FILE).is_file():  # a checkpoint: it and the older ones beside it
        try:
            named = verify_checkpoint(path)
        except CheckpointError as err:
            raise ForwardError(f"the model: {err}") from None
        if path.parent.name != "checkpoints" or \
                path.name not in {p.name for p in list_checkpoints(path.parent)}:
            return [(path, named)], None, []
        ckpt_dir, run_dir, newest = path.parent, path.parent.parent, _step(path)
    elif (path / "checkpoints").is_dir():
        ckpt_dir, run_dir, newest, named = path / "checkpoints", path, None, {}
    else:
        find_checkpoint(spec)  # raises the error that names what the model should be
        raise AssertionError(f"find_checkpoint accepted {spec}")  # pragma: no cover
    skipped: list[str] = []
    found: Found = []
    for older in reversed(list_checkpoints(ckpt_dir)):
        if newest is not None and _step(older) >= newest:
            if _step(older) == newest:
                found.append((older, named))  # the one named, verified above
            continue
        try:
            found.append((older, verify_checkpoint(older)))
        except CheckpointError as err:
            skipped.append(f"skipped {err}")
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ForwardError(f"the model {path}: the run has no valid checkpoint in {ckpt_dir}"
                           f"{why}; train it (or resume it) to a checkpoint first, or pass "
                           "another run")
    return found, run_dir, skipped


def _eval_records(path: Path) -> dict[int, float]:
    """Each evaluated step's held-out loss in a ``metrics.jsonl`` (the last record wins)."""
    try:
        records = read_metrics(path)
    except ValueError as err:
        raise ForwardError(f"--avg-best: {err}") from None
    losses: dict[int, float] = {}
    for record in records:
        loss = record.get("heldout_loss")
        if record.get("kind") == "eval" and isinstance(loss, (int, float)) \
                and math.isfinite(loss) and isinstance(record.get("step"), int):
            losses[record["step"]] = float(loss)
    return losses


def heldout_losses(found: Found, run_dir: Path | None) -> dict[Path, float]:
    """The held-out loss of each checkpoint that has one (module docstring).

    Raises:
        ForwardError: If the run's ``metrics.jsonl`` is needed and damaged, naming it.
    """
    losses = {p: loss for p, manifest in found if (loss := heldout_loss(manifest)) is not None}
    missing = [p for p, _ in found if p not in losses]
    metrics = run_dir / METRICS_FILE if run_dir is not None else None
    if missing and metrics is not None and metrics.is_file():
        records = _eval_records(metrics)
        losses.update({p: records[_step(p)] for p in missing if _step(p) in records})
    return losses


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths)


def choose(spec: str | Path, newest: int = 0, best: int = 0
           ) -> tuple[list[Path], Path | None, str, list[str]]:
    """The checkpoints to average: the newest ``newest``, or the ``best`` by held-out loss.

    Returns:
        ``(checkpoints, run directory, how they were chosen, skipped)``; the checkpoints
        newest first (``newest``) or best first (``best``).

    Raises:
        ForwardError: If there are fewer candidates than asked for (saying how many there
            are, and which have no held-out loss).
    """
    flag = f"--avg {newest}" if newest else f"--avg-best {best}"
    found, run_dir, skipped = complete_checkpoints(spec)
    paths = [p for p, _ in found]
    why = f" ({'; '.join(skipped)})" if skipped else ""
    where = run_dir if run_dir is not None else Path(spec)
    if newest:
        if newest > len(paths):
            raise ForwardError(
                f"{flag}: {where} has {len(paths)} complete checkpoint"
                f"{'s' if len(paths) != 1 else ''} ({_names(paths)}){why}; pass "
                f"--avg {len(paths)} or fewer, or train with --keep-checkpoints {newest} (or "
                "0: keep all) to keep more")
        return paths[:newest], run_dir, f"newest {newest}", skipped
    losses = heldout_losses(found, run_dir)
    scored = [p for p in paths if p in losses]
    if best > len(scored):
        unscored = [p for p in paths if p not in losses]
        note = (f"; {_names(unscored)} {'has' if len(unscored) == 1 else 'have'} no held-out "
                f"evaluation of {'its' if len(unscored) == 1 else 'their'} step (in "
                f"{'its' if len(unscored) == 1 else 'their'} manifest or {METRICS_FILE})"
                if unscored else "")
        fix = (f"pass --avg-best {len(scored)} or fewer, or " if scored else "pass --avg N, or ")
        raise ForwardError(
            f"{flag}: {where} has {len(scored)} complete checkpoint"
            f"{'s' if len(scored) != 1 else ''} with a held-out loss"
            f"{f' ({_names(scored)})' if scored else ''}{note}{why}; {fix}keep more "
            "checkpoints in training (--keep-checkpoints, --keep-best)")
    # Lowest loss first; a tie goes to the newer checkpoint (paths is newest first).
    order = sorted(scored, key=lambda p: losses[p])[:best]
    figures = ", ".join(f"{losses[p]:.4f}" for p in order)
    return order, run_dir, f"best {best} by held-out loss: {figures}", skipped


def _architecture(config: dict[str, Any], weights: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree between checkpoints averaged together."""
    shapes = tuple((k, tuple(v.shape)) for k, v in weights.items()
                   if isinstance(v, torch.Tensor))
    return config["model"]["preset"], shapes


def _difference(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    """The first way two :func:`_architecture` values differ, as a phrase."""
    if a[0] != b[0]:
        return f"it is a {b[0]!r} BLSTM, not a {a[0]!r} one"
    want, have = dict(a[1]), dict(b[1])
    for name in [*want, *(k for k in have if k not in want)]:
        if want.get(name) != have.get(name):
            return (f"its {name} is {list(have[name]) if name in have else 'missing'}, not "
                    f"{list(want[name]) if name in want else 'absent'}")
    return "its parameters are in another order"


def average_weights(paths: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """The element-wise mean of the deployable weights of ``paths`` (verified checkpoints).

    Floating-point tensors are summed in float64 and cast back to their own dtype; any other
    tensor (a counter) is taken from the first checkpoint.

    Returns:
        ``(weights, the first checkpoint's configuration, the weights' key)``.

    Raises:
        ForwardError: If a checkpoint is not the first one's architecture, naming both.
    """
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    first: tuple[Any, ...] = ()
    config: dict[str, Any] = {}
    key = "model"
    for i, path in enumerate(paths):
        # Verified when chosen: each file is hashed once.
        weights, conf, this_key = deployable(read_state(path, verify=False), path)
        shape = _architecture(conf, weights)
        if i == 0:
            first, config, key = shape, conf, this_key
            dtypes = {k: v.dtype for k, v in weights.items() if v.is_floating_point()}
            total = {k: v.double() if k in dtypes else v.clone() for k, v in weights.items()}
            continue
        if shape != first:
            raise ForwardError(f"cannot average {path} with {paths[0]}: "
                               f"{_difference(first, shape)}; average checkpoints of one run")
        for name in dtypes:
            total[name] += weights[name].double()
    mean = {k: (v / len(paths)).to(dtypes[k]) if k in dtypes else v for k, v in total.items()}
    return mean, config, key


def load_averaged(spec: str | Path, newest: int = 0, best: int = 0) -> LoadedModel:
    """The model ``spec`` names, averaged over checkpoints if ``newest`` or ``best`` is set.

    Without either it is :func:`~hadpsgd.forward.model.load_model`'s. One checkpoint chosen
    (``--avg 1``, ``--avg-best 1``) is that checkpoint's own weights.

    Raises:
        ForwardError: Naming the checkpoint or the flag, and the fix.
    """
    if not newest and not best:
        return load_model(spec)
    paths, run_dir, how, skipped = choose(spec, newest, best)
    weights, config, key = average_weights(paths)
    model = build(weights, config, paths[0])
    return LoadedModel(model, paths[0], run_dir, config, key,
                       averaged=tuple(paths) if len(paths) > 1 else (),
                       selection=how if len(paths) > 1 else "", skipped=tuple(skipped))
