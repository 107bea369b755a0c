"""A resume trains on the data it resumes: the files' identity is in every checkpoint.

``--train`` and ``--heldout`` name paths, and a resume refuses another path
(:mod:`hadpsgd.assembly.resume_config`). The same path can hold other data by then: a
regenerated or re-imported set, another copy under the old name. The run would go on over
another chunk order at the same epoch position, silently. So each checkpoint records the
fingerprint of both files (:meth:`hadpsgd.data.FeatureFile.current_stamp`: the frame,
utterance and class counts, the feature dimension, checksums of every label and offset, and
of 16 frames sampled across the file; it costs one read of 16 frames at start-up), and a
resume compares them before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hadpsgd.cli import ConfigError
from hadpsgd.data import FeatureFile

IDENTITY_KEY = "data_identity"
"""The key of the data's fingerprints in a checkpoint's configuration (``state.pt`` and the
manifest's ``config``)."""
SPLITS = ("train", "heldout")
_FIELDS = ("frames", "utts", "num_classes", "feat_dim", "labels_crc32", "offsets_crc32",
           "feats_sample_crc32")


def identity(train: FeatureFile, heldout: FeatureFile) -> dict[str, dict[str, Any]]:
    """The fingerprints of the run's two files, as recorded in its checkpoints."""
    out = {}
    for split, ff in zip(SPLITS, (train, heldout), strict=True):
        stamp = ff.current_stamp()
        out[split] = {"path": str(ff.path), **{k: stamp[k] for k in _FIELDS if k in stamp}}
    return out


def _what_differs(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first differences in words: counts by value, checksums by name."""
    said = []
    for key in _FIELDS:
        if key in old and key in new and old[key] != new[key]:
            if key.endswith("crc32"):
                said.append(f"{key.removesuffix('_crc32').replace('_', ' ')} checksum")
            else:
                said.append(f"{key} {old[key]} -> {new[key]}")
    return ", ".join(said)


def data_changes(saved: dict[str, Any] | None, now: dict[str, dict[str, Any]]
                 ) -> list[tuple[str, str]]:
    """(split, what differs) for each file whose data is not the checkpoint's.

    A checkpoint written before the fingerprints were recorded has none: nothing to compare.
    """
    if not isinstance(saved, dict):
        return []
    changes = []
    for split in SPLITS:
        old = saved.get(split)
        if isinstance(old, dict) and isinstance(now.get(split), dict):
            differs = _what_differs(old, now[split])
            if differs:
                changes.append((split, differs))
    return changes


def check_resume_data(checkpoint: Path | None, saved: dict[str, Any] | None,
                      now: dict[str, dict[str, Any]], allowed: set[str]) -> list[str]:
    """Refuse a resume whose ``--train`` or ``--heldout`` holds other data than its run's.

    Args:
        checkpoint: The checkpoint resumed from (None: a fresh start, nothing to check).
        saved: That checkpoint's configuration (its :data:`IDENTITY_KEY` entry is read).
        now: :func:`identity` of the files opened now.
        allowed: The names ``--allow-resume-change`` gives (``train``, ``heldout``, ``all``).

    Returns:
        The allowed changes in words (the resume then carries the model over, not exactly).

    Raises:
        ConfigError: Naming each file, what differs, and the ways on.
    """
    if checkpoint is None or not isinstance(saved, dict):
        return []
    changes = data_changes(saved.get(IDENTITY_KEY), now)
    refused = [(s, d) for s, d in changes if s not in allowed and "all" not in allowed]
    if refused:
        files = "; ".join(f"--{s} {now[s]['path']} ({d})" for s, d in refused)
        names = ",".join(s for s, _ in refused)
        raise ConfigError(
            f"--resume continues the run of {checkpoint}, but its data changed since that "
            f"checkpoint was written: {files}. Point --{refused[0][0]} at the data the run "
            f"was trained on, or pass --allow-resume-change {names} to carry its model over "
            "to this data (not an exact continuation), or start a new run in another --out-dir")
    return [f"--{s} data ({d})" for s, d in changes]


def check_same_data(every: list[dict[str, dict[str, Any]]], hosts: list[str]) -> None:
    """Refuse ranks whose ``--train`` or ``--heldout`` holds other data than rank 0's.

    Where each host reads its own copy of the data (local scratch), a stale or partial copy
    on one host would train its learners on other utterances, silently.

    Args:
        every: Every rank's :func:`identity`, by rank.
        hosts: Every rank's host name, by rank.

    Raises:
        ConfigError: On every rank alike, naming the ranks, hosts and what differs.
    """
    differ = []
    for rank, theirs in enumerate(every[1:], start=1):
        for split, what in data_changes(every[0], theirs):
            differ.append(f"rank {rank} on {hosts[rank]}: --{split} {theirs[split]['path']} "
                          f"({what})")
    if differ:
        shown = "; ".join(differ[:4]) + ("; ..." if len(differ) > 4 else "")
        raise ConfigError(
            f"the ranks read other data than rank 0 (on {hosts[0]}) under the same flags: "
            f"{shown}; copy the same files to every host (or read them from a file system "
            "every host shares)")

