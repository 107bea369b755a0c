"""One forward job: the checks every rank agrees on, its share of the utterances, the parts.

Under mpirun the utterances are split into contiguous runs, one per rank, balanced by frames
(:func:`split_by_frames`); each rank writes its part and rank 0 makes one output of them
(:mod:`hadpsgd.forward.output`). One process is the same job with one part. Every file is
written under a temporary name and renamed when complete; one that is there already is
refused before any work (:func:`check_new`) unless ``--overwrite``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from hadpsgd.comm import Topology
from hadpsgd.data import FeatureFileError, Priors, PriorsError
from hadpsgd.forward.chunks import batches, check_windows, forward_batch
from hadpsgd.forward.features import Features, KaldiFeatures
from hadpsgd.forward.model import ForwardError, LoadedModel, check_priors
from hadpsgd.forward.output import (
    ArkWriter,
    H5Writer,
    OutputSpec,
    merge,
    open_writer,
    part_spec,
)
from hadpsgd.forward.sidecar import write_sidecars

USER_ERRORS = (ForwardError, FeatureFileError, PriorsError, ValueError, FileNotFoundError,
               ImportError)
"""Errors a user causes, found before any work: one line, exit 2."""

T = TypeVar("T")


def log(message: str) -> None:
    """A status line on standard error (standard output may carry the archive: ``ark:-``)."""
    print(f"[hadpsgd.forward] {message}", file=sys.stderr, flush=True)


def agree(topo: Topology, check: Callable[[], T]) -> T:
    """Run ``check`` on every rank; if it fails anywhere, fail everywhere with that message.

    Raises:
        ForwardError: The first failing rank's message (named by rank under mpirun).
    """
    result: T | None = None
    problem = None
    try:
        result = check()
    except USER_ERRORS as err:
        problem = str(err) or type(err).__name__
    problems = topo.allgather_object(problem) if topo.size > 1 else [problem]
    for rank, found in enumerate(problems):
        if found is not None:
            raise ForwardError(found if topo.size == 1 or rank == 0 else f"rank {rank}: {found}")
    return result  # type: ignore[return-value] - set whenever no rank failed


@dataclass(frozen=True)
class Options:
    """How to run the model (the CLI's flags, resolved)."""

    context: str
    chunk_len: int
    overlap: int
    precision: str
    progress: bool
    prior_scale: float = 1.0
    """The priors' exponent: pseudo-log-likelihoods ``log p(s|x) - prior_scale log p(s)``."""

    def __post_init__(self) -> None:
        if self.context == "chunks":
            check_windows(self.chunk_len, self.overlap)

    def describe(self) -> str:
        """The context as one phrase."""
        if self.context == "whole":
            return "whole utterances"
        return (f"windows of {self.chunk_len} frames, {self.overlap} of context each side, "
                f"keeping {self.chunk_len - 2 * self.overlap}")


def split_by_frames(lengths: list[int], size: int) -> list[tuple[int, int]]:
    """Contiguous utterance ranges ``[first, stop)``, one per rank, of about equal frames.

    Utterance ``u`` goes to the rank whose share of the frames holds its middle frame, so
    ranks differ by at most about one utterance, and rank order is input order.
    """
    lens = np.asarray(lengths, dtype=np.float64)
    total = lens.sum()
    if total == 0:
        owner = np.minimum(np.arange(len(lens)) * size // max(len(lens), 1), size - 1)
    else:
        middle = np.cumsum(lens) - lens / 2
        owner = np.minimum((middle * size / total).astype(np.int64), size - 1)
    bounds = np.searchsorted(owner, np.arange(size + 1), side="left")
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(size)]


def learn_index(topo: Topology, features: Features) -> None:
    """Make a Kaldi table's index known to every rank (rank 0 reads it once)."""
    if not isinstance(features, KaldiFeatures):
        return
    if topo.size == 1:  # streamed once; the first utterance tells the dimension
        agree(topo, features.peek_dim)
        return
    if features.stdin:
        raise ForwardError("--features ark:- (standard input) reaches rank 0 only; under "
                           "mpirun write the features to a file (ark:feats.ark) or an scp")

    def rank0() -> Any:
        return features.learn_index() if topo.rank == 0 else None

    agree(topo, rank0)
    mine = (features.index, features.feat_dim) if topo.rank == 0 else None
    features.index, features.feat_dim = topo.bcast_object(mine, root=0)


def check_shapes(loaded: LoadedModel, features: Features, priors: Priors | None) -> None:
    """Refuse features or priors that do not fit the checkpoint, naming both numbers."""
    if features.feat_dim != loaded.input_dim:
        raise ForwardError(
            f"feature dimension mismatch: checkpoint {loaded.checkpoint} was trained on "
            f"{loaded.input_dim}-dim features but --features {features.name} has "
            f"{features.feat_dim}-dim ones; pass features made like its training set's "
            f"({loaded.train_file or 'see its config.json'}), or the model trained on these")
    if features.num_classes is not None and features.num_classes != loaded.num_classes:
        raise ForwardError(
            f"class count mismatch: checkpoint {loaded.checkpoint} has {loaded.num_classes} "
            f"output classes but --features {features.name} has {features.num_classes} classes; "
            "pass features labelled with the training's tree (e.g. imported with --like TRAIN.h5), "
            "or the model trained on these")
    check_priors(loaded, priors)


def targets(out: OutputSpec, size: int) -> list[Path]:
    """Every file a job of ``size`` ranks writes under a final name (each rank's part too)."""
    if size == 1:
        return out.files()
    parts = [f for r in range(size) for f in part_spec(out, r).files()]
    if out.h5 is not None:
        return [out.h5, *parts]
    return [Path(out.scp or out.ark or ""), *parts]  # under an scp the rank archives stay


def check_new(out: OutputSpec, size: int, overwrite: bool) -> None:
    """Refuse to write over files that are there, unless ``overwrite``; never over a directory.

    Under mpirun a part left by a job that died before its merge counts too: it is named
    like any other file, and ``--overwrite`` replaces it.

    Raises:
        ForwardError: Naming every such file and the fix.
    """
    found = targets(out, size)
    dirs = [str(p) for p in found if p.is_dir()]
    if dirs:
        raise ForwardError(f"--out: {', '.join(dirs)} is a directory; write elsewhere")
    there = [str(p) for p in found if p.exists() or p.is_symlink()]
    if there and not overwrite:
        raise ForwardError(f"--out: {', '.join(there)} already exist"
                           f"{'s' if len(there) == 1 else ''}; pass --overwrite to replace "
                           f"{'it' if len(there) == 1 else 'them'}, or write elsewhere")


def retire_index(topo: Topology, out: OutputSpec) -> None:
    """Under mpirun with ``--overwrite``: remove an old ``scp`` before any rank writes.

    Its offsets point into the rank archives by name; the new ``out.<rank>.ark`` files take
    those names as each rank finishes, long before rank 0 writes the new ``scp``. Rank 0
    removes it, and the agreement after it is the barrier no rank renames before.
    """
    if topo.size == 1 or out.scp is None:
        return  # one process: the writer removes the old index just before its archive moves
    index = Path(out.scp)
    agree(topo, lambda: index.unlink(missing_ok=True) if topo.rank == 0 else None)


@dataclass
class Job:
    """Everything one forward run needs, checked."""

    loaded: LoadedModel
    features: Features
    out: OutputSpec
    priors: Priors | None
    opts: Options


def _to_device(feats: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The utterances' features on ``device``.

    On CUDA in one copy from pinned memory that the host does not wait for (a copy per
    utterance from pageable memory waited for each); elsewhere the arrays themselves.
    """
    if device.type != "cuda":
        return [torch.from_numpy(f).to(device) for f in feats]
    lengths = [len(f) for f in feats]
    host = torch.empty((sum(lengths), feats[0].shape[1]), pin_memory=True,
                       dtype=torch.from_numpy(feats[0][:0]).dtype)
    np.concatenate(feats, out=host.numpy())
    return list(host.to(device, non_blocking=True).split(lengths))


class _Scores:
    """A group's scores on their way to the host: one copy, waited for when written.

    The host synchronises with the GPU once per group (on a blocking-sync event, which
    sleeps instead of spinning a core), not once per utterance.
    """

    def __init__(self, group: list[tuple[str, np.ndarray]], outputs: list[torch.Tensor],
                 log_priors: torch.Tensor | None) -> None:
        self.ids = [utt for utt, _ in group]
        self.lengths = [len(feats) for _, feats in group]
        self.frames = sum(self.lengths)
        flat = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if log_priors is not None:
            flat = flat - log_priors  # log p(s|x) - P log p(s)
        self.done: torch.cuda.Event | None = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event(blocking=True)
            self.done.record()
            flat = host
        self.host = flat

    def write(self, writer: H5Writer | ArkWriter, bar: tqdm) -> int:
        """Wait for the copy, write every utterance, and return how many."""
        if self.done is not None:
            self.done.synchronize()
        rows = self.host.numpy()
        for utt, start, length in zip(self.ids, np.cumsum([0, *self.lengths[:-1]]),
                                      self.lengths, strict=True):
            writer.write(utt, rows[start:start + length])
            bar.update(length)
        return len(self.ids)


def run(topo: Topology, job: Job) -> dict[str, Any]:
    """Run the model over this rank's utterances, write its part, and (rank 0) merge.

    Returns:
        On rank 0: ``utterances``, ``frames``, ``seconds``, ``files``; elsewhere the rank's
        own counts.
    """
    loaded, features, out, priors, opts = job.loaded, job.features, job.out, job.priors, \
        job.opts
    start = time.perf_counter()
    first, stop, total = 0, None, None
    if features.index is not None:
        ranges = split_by_frames([n for _, n in features.index], topo.size)
        first, stop = ranges[topo.rank]
        total = sum(n for _, n in features.index[first:stop])
    model = loaded.model.to(topo.device).eval()
    log_priors = None
    if priors is not None:
        log_priors = torch.as_tensor(priors.scaled_log(opts.prior_scale),
                                     dtype=torch.float32, device=topo.device)
    mine = part_spec(out, topo.rank) if topo.size > 1 else out
    attrs = {"kind": "pseudo-log-likelihoods" if priors else "log-posteriors",
             "priors": priors.source if priors else "", "checkpoint": loaded.source,
             "context": opts.context, "chunk_len": opts.chunk_len,
             "chunk_overlap": opts.overlap, "precision": opts.precision,
             "prior_scale": opts.prior_scale if priors else 0.0}
    writer = open_writer(mine, loaded.num_classes, attrs)
    utts = frames = 0
    bar = tqdm(total=total, unit="frame", unit_scale=True, file=sys.stderr, leave=False,
               desc="forward" if topo.size == 1 else f"forward (rank 0 of {topo.size})",
               disable=not (opts.progress and topo.rank == 0))
    pending: _Scores | None = None
    try:
        for group in batches(features.read(first, stop), loaded.num_classes):
            inputs = _to_device([feats for _, feats in group], topo.device)
            outputs = forward_batch(model, inputs, opts.context, opts.chunk_len, opts.overlap,
                                    opts.precision)
            # Written one group late: the host writes group k while the GPU runs group k + 1.
            scores = _Scores(group, outputs, log_priors)
            if pending is not None:
                utts, frames = utts + pending.write(writer, bar), frames + pending.frames
            pending = scores
        if pending is not None:
            utts, frames = utts + pending.write(writer, bar), frames + pending.frames
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    counts = topo.gather_object((utts, frames)) if topo.size > 1 else [(utts, frames)]
    if topo.rank != 0:
        return {"utterances": utts, "frames": frames}
    assert counts is not None
    files = merge(out, topo.size) if topo.size > 1 else [out.describe()]
    files += write_sidecars(out, loaded.num_classes, attrs)  # what a Kaldi archive holds
    return {"utterances": sum(u for u, _ in counts), "frames": sum(f for _, f in counts),
            "seconds": time.perf_counter() - start, "files": files}
