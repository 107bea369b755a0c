"""A resume runs the run it resumes: its own configuration, not today's defaults.

Without this, a ``--resume auto`` that repeats only some flags would fill the others from the
defaults (another learning rate, momentum, batch, seed) and rewrite ``config.json`` with them.
Here the configuration is the checkpoint's; a flag given on the resume that differs from it
is refused, naming each difference, unless it may change (:data:`MAY_CHANGE`) or
``--allow-resume-change`` names it. It runs before MPI starts (the run's layout,
``--ranks-per-node`` and the device, decide how MPI is set up), on every rank alike from the
same files, and before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, get_type_hints

from hadpsgd.cli import ConfigError, flag, from_namespace, option_name
from hadpsgd.config import FORMER_SECTION, RunConfig, check_read
from hadpsgd.train.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
)

MAY_CHANGE = ("epochs", "max_steps", "log_every", "progress", "tensorboard", "checkpoint_every",
              "keep_checkpoints", "keep_best", "num_workers", "max_nonfinite", "cuda_graph")
"""Options a resume may change freely: how long, how often it logs and checkpoints, how many
loader workers, how many non-finite steps it tolerates from now on, and whether the model's
passes replay CUDA graphs. None changes what the steps compute."""
START_ONLY = ("resume", "out_dir", "overwrite", "allow_resume_change")
"""Options of this start, not of the run."""
PATHS = ("train", "heldout")


def _sections(cls: type = RunConfig) -> dict[str, tuple[str, str]]:
    """Every option's name -> (section, field name) in a saved configuration."""
    hints = get_type_hints(cls)
    where: dict[str, tuple[str, str]] = {}
    for sec in dataclasses.fields(cls):
        for f in dataclasses.fields(hints[sec.name]):
            where[option_name(f)] = (sec.name, f.name)
    return where


def flatten(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration (``config.json``'s sections) as option name -> value.

    A run saved before an option moved section holds it in its former one
    (:data:`~hadpsgd.config.FORMER_SECTION`: ``train.precision`` for ``precision.precision``).
    """
    flat = {}
    for name, (sec, field_name) in _sections().items():
        for where in (sec, FORMER_SECTION.get(name)):
            section = saved.get(where) if where else None
            if isinstance(section, dict) and field_name in section:
                flat[name] = section[field_name]
                break
    return flat


def allowed(cfg: RunConfig) -> set[str]:
    """The option names ``--allow-resume-change`` lets differ ('all': every one, 'np')."""
    text = cfg.checkpoint.allow_resume_change or ""
    return {part.strip().lstrip("-").replace("-", "_") for part in text.split(",")
            if part.strip()}


def _same(name: str, old: Any, new: Any) -> bool:
    if name in PATHS and isinstance(old, str) and isinstance(new, str):
        return Path(old).resolve() == Path(new).resolve()
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) \
            and not isinstance(old, bool) and not isinstance(new, bool):
        return float(old) == float(new)
    return old == new


def resume_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint a resume would continue from, or None where there is none.

    Picked by its manifest, without checksums yet (rank 0 verifies the one it loads); None
    means a fresh start.
    """
    resume = cfg.checkpoint.resume
    if resume != "auto":
        return Path(resume) if resume else None
    for path in reversed(list_checkpoints(Path(cfg.train.out_dir or ".") / "checkpoints")):
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        return path
    return None


def saved_config(path: Path) -> dict[str, Any] | None:
    """The configuration checkpoint ``path`` was written with, or None if unreadable.

    Read from its manifest; a checkpoint of an older version holds it in ``state.pt`` only.
    """
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(manifest, dict) and isinstance(manifest.get("config"), dict):
        return manifest["config"]
    if not (path / STATE_FILE).is_file():
        return None
    try:
        config = load_checkpoint(path, verify=False).get("config")
    except CheckpointError:
        return None
    return config if isinstance(config, dict) else None


def differences(cfg: RunConfig, saved: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The options of the resumed run, and the refused differences (flag, value, the run's).

    Options not given take the run's value; given ones that may change, or that
    ``--allow-resume-change`` names, take the given value.
    """
    run = flatten(saved)
    ok = allowed(cfg)
    values = {**run}
    refused = []
    for name, value in cfg.given().items():
        if name in START_ONLY or name not in run or _same(name, run[name], value):
            values[name] = value
            continue
        if name in MAY_CHANGE or "all" in ok or name in ok:
            values[name] = value
            continue
        refused.append(f"{flag(name)} {value} (the run has {run[name]})")
    where = _sections()
    for name in START_ONLY:  # what this start said, or the default: never the old start's
        section, field_name = where[name]
        values[name] = getattr(getattr(cfg, section), field_name)
    return values, refused


def resumed_config(cfg: RunConfig) -> tuple[RunConfig, Path | None]:
    """``cfg`` as the run it resumes was configured, and the checkpoint it was read from.

    A fresh start (no ``--resume``, or ``--resume auto`` where no checkpoint is) returns
    ``cfg`` unchanged.

    Raises:
        ConfigError: For an option the run's algorithm does not read (the resumed run's, not
            the default ``--algo``); naming every refused difference, the flags that may
            change, and the two ways on (drop them, or ``--allow-resume-change``).
    """
    path = resume_checkpoint(cfg)
    if path is None or not path.is_dir():
        # A fresh start: parse_config left the check to here for want of the run's --algo.
        check_read(cfg.train.algo, cfg.given())
        cfg.algo_options().check_read(cfg.typed())
        return cfg, None  # resume() names a missing --resume PATH, or starts afresh
    saved = saved_config(path)
    if saved is None:
        return cfg, path  # resume() names the broken checkpoint
    values, refused = differences(cfg, saved)
    # Before the differences: another algorithm's option differs from the run's saved
    # (unused) value, and "the run has 8" would hide that the run never reads it.
    check_read(values.get("algo", cfg.train.algo), cfg.given(), resumed=str(path))
    if refused:
        may = ", ".join(flag(n) for n in MAY_CHANGE)
        names = ",".join(r.split()[0].lstrip("-") for r in refused)
        raise ConfigError(
            f"--resume continues the run of {path} as it was configured, and these flags "
            f"differ from it: {'; '.join(refused)}. Drop them to continue it as it was (flags "
            f"that may change on a resume: {may}); to change them anyway pass "
            f"--allow-resume-change {names} (not an exact continuation), or start a new run "
            "in another --out-dir")
    ns = argparse.Namespace(**values)
    try:
        resolved = from_namespace(RunConfig, ns)
    except ConfigError as err:
        raise ConfigError(f"the configuration of {path} no longer validates ({err}); start a "
                          "new run in another --out-dir") from None
    resolved.algo_options().check_read(cfg.typed())  # against the run's wire
    resolved._given = cfg.given()  # type: ignore[attr-defined]
    resolved._typed = cfg.typed()  # type: ignore[attr-defined]
    return resolved, path
