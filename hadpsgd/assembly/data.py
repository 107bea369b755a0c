"""The data of a run, checked before anything is built: files, sizes, every frame finite.

Everything a user can get wrong about ``--train`` / ``--heldout`` is found here, on every
rank alike, before a model or an output directory exists: the structure and every label when
a file opens (and, for a stamped file, that its data is what the stamp vouches for), every
frame by a parallel scan unless the file's stamp vouches for them. A frame changed in place
after its file was stamped is found when training reads it
(:meth:`hadpsgd.data.FeatureFile.read`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hadpsgd.comm import Topology
from hadpsgd.config import RunConfig
from hadpsgd.data import ChunkDataset, FeatureFile, FeatureFileError
from hadpsgd.data.pipeline import cmvn_mismatch
from hadpsgd.data.validate import VALIDATE_COMMAND, nonfinite_error, path_problem, scan_frames


def load_data(cfg: RunConfig, topo: Topology) -> tuple[ChunkDataset, ChunkDataset]:
    """The training and held-out chunks, checked (shapes, labels, sizes, every frame finite).

    Raises:
        FeatureFileError: For a missing, malformed or too small file, a label out of range,
            or a file changed after it was stamped, naming it and the fix.
    """
    train_path, heldout_path = resolve_data(cfg, topo)
    verify = cfg.data.verify_data
    train_set = ChunkDataset(train_path, cfg.data.chunk_len, verify=verify)
    heldout_set = ChunkDataset(heldout_path, cfg.data.chunk_len,
                               expected_feat_dim=train_set.file.feat_dim, verify=verify)
    if heldout_set.file.num_classes != train_set.file.num_classes:
        raise FeatureFileError(
            f"{heldout_path} has {heldout_set.file.num_classes} classes but {train_path} has "
            f"{train_set.file.num_classes}; both splits must share one label set"
        )
    mismatch = cmvn_mismatch(train_path, heldout_path)  # the Kaldi imports' CMVN records
    if mismatch is not None:
        raise FeatureFileError(mismatch)
    check_chunk_len(train_set)
    check_steps(train_set, cfg.train.batch_size, topo.size)
    files = [train_set.file, heldout_set.file]
    if topo.rank == 0:
        note = heldout_overlap(train_set.file, heldout_set.file)
        if note:
            print(f"[hadpsgd] note: {note}", flush=True)
        for ff in files:
            if ff.old_stamp and not verify:
                print(f"[hadpsgd] note: {ff.path}: its validated stamp is an older hadpsgd's, "
                      f"without a fingerprint of the data, so every frame is scanned at each "
                      f"start; {VALIDATE_COMMAND} {ff.path} stamps it anew", flush=True)
    validate_data(files, topo)
    return train_set, heldout_set


def resolve_data(cfg: RunConfig, topo: Topology) -> tuple[Path, Path]:
    """Training and held-out file paths; generates the synthetic default set on first use.

    Rank 0 generates (into a temp dir renamed into place, so an interrupted generation is
    never mistaken for a finished one); the other ranks wait for it under the deadline.

    Raises:
        FeatureFileError: If a given path does not exist or cannot be read (a directory, no
            permission, an empty file), naming the flag, the path and the fix.
    """
    if cfg.data.train is not None and cfg.data.heldout is not None:
        paths = (Path(cfg.data.train), Path(cfg.data.heldout))
        for flag_name, p in zip(("--train", "--heldout"), paths, strict=True):
            problem = path_problem(p)
            if problem is not None:
                raise FeatureFileError(f"{flag_name} {p}: {problem}")
        return paths
    from hadpsgd.data import default_dataset
    from hadpsgd.data.synth import SynthSpec

    generated = None
    if topo.rank == 0:
        spec = SynthSpec(train_utts=cfg.data.synthetic_utts)
        generated = tuple(str(p) for p in default_dataset(spec=spec))
        print(f"[hadpsgd] synthetic data: {generated[0]}, {generated[1]}", flush=True)
    generated = topo.bcast_object(generated, root=0)
    return Path(generated[0]), Path(generated[1])


def check_chunk_len(train_set: ChunkDataset) -> None:
    """Refuse a ``--chunk-len`` longer than every training utterance.

    Each utterance shorter than a chunk is one chunk padded to its length, so beyond the
    longest utterance every frame added is padding: memory and compute spent on nothing (a
    ``--chunk-len 2100`` meant as 21 runs, 100 times the work, without a word).

    Raises:
        FeatureFileError: Naming the longest utterance's length and the flag.
    """
    longest = int(np.diff(train_set.file.offsets).max())
    if train_set.chunk_len > longest:
        raise FeatureFileError(
            f"--chunk-len {train_set.chunk_len} is longer than the longest utterance of "
            f"{train_set.file.path} ({longest} frames): every chunk would be padded past it, "
            f"memory and compute spent on padding; use --chunk-len {longest} or less (the "
            "paper's unroll is 21)")


def heldout_overlap(train: FeatureFile, heldout: FeatureFile) -> str | None:
    """Why the held-out loss would not measure unseen data, or None.

    The same file for both, or utterance ids found in both: often a slip (the training file
    passed twice, a split made twice), and the held-out loss then measures fit.
    """
    if train.path.resolve() == heldout.path.resolve():
        return (f"--heldout {heldout.path} is the training file: the held-out loss measures "
                "the fit to the training data, not unseen data")
    shared = len(set(train.utt_ids) & set(heldout.utt_ids))
    if shared:
        return (f"{shared} of the {heldout.num_utts} utterances of --heldout {heldout.path} "
                f"are also in --train {train.path} (the same ids): the held-out loss is not "
                "on unseen data only")
    return None


def check_steps(train_set: ChunkDataset, batch_size: int, world_size: int) -> None:
    """Refuse training data too small for one step.

    Held-out data always has a chunk: a short utterance is one padded chunk.

    Raises:
        FeatureFileError: Naming the file, its chunk count, the global batch and the fixes.
    """
    global_batch = batch_size * world_size
    if len(train_set) < global_batch:
        # The sampler drops the incomplete last global batch: an epoch would have no step.
        raise FeatureFileError(
            f"{train_set.file.path}: {len(train_set)} chunks of {train_set.chunk_len} frames, "
            f"fewer than one global batch of {global_batch} ({batch_size} per learner x "
            f"{world_size} learners), so an epoch would have zero steps; use a smaller "
            f"--batch-size or --chunk-len, fewer learners, or more training data")


def _scan_share(ff: FeatureFile, rank: int, size: int) -> int | str | None:
    """This rank's contiguous share of ``ff``: first bad frame, read-error message or None."""
    start, stop = ff.num_frames * rank // size, ff.num_frames * (rank + 1) // size
    try:
        return scan_frames(ff, start, stop)
    except FeatureFileError as err:
        # Reported, not raised: the other ranks must learn of it in the agreement below
        # instead of waiting for a rank that has left.
        return str(err)
    finally:
        # Scanning opened a handle in this process; closed so that forked loader workers do
        # not inherit it (they would reopen their own anyway).
        ff.close()


def validate_data(files: Sequence[FeatureFile], topo: Topology) -> None:
    """Check every stored frame of ``files`` for NaN/Inf values and read errors, in parallel.

    Each rank scans a contiguous ``1/size`` share of every file; one allgather then tells
    every rank what all shares found, so all ranks raise the same error (or none does) and
    no rank is left waiting in a later collective. Shares are in rank order, so the lowest
    rank that found something holds the earliest problem of the file. (The Topology reduces
    only with ``avg``/``sum``, and the read-error message must travel too: hence an object
    allgather of a few bytes rather than a MIN allreduce.)

    Args:
        files: The feature files the run reads (all ranks pass the same ones, in order).
        topo: The learners.

    Raises:
        FeatureFileError: On every rank, for the first file with a problem: a non-finite
            value (naming the frame and utterance) or an unreadable part of the file.
    """
    # A file whose stamp vouches for it is not rescanned (unless --verify-data): opening it
    # checked that its data is what was stamped, and read() finds a frame changed since.
    files = [ff for ff in files if not ff.stamped]
    if not files:
        return
    local = [_scan_share(ff, topo.rank, topo.size) for ff in files]
    for ff, found in zip(files, zip(*topo.allgather_object(local), strict=True), strict=True):
        for problem in found:
            if isinstance(problem, str):
                raise FeatureFileError(problem)
            if problem is not None:
                raise nonfinite_error(ff, problem)
