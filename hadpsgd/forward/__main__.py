"""``python -m hadpsgd.forward``: a trained BLSTM's per-frame scores, for a decoder.

    python -m hadpsgd.forward RUN_DIR --features test.h5 --out ark,scp:o.ark,o.scp
    mpirun -np 4 python -m hadpsgd.forward RUN_DIR --features scp:feats.scp --out o.h5

The model is the first argument and the output ``--out``, as in ``hadpsgd.export``; the older
``--model RUN_DIR`` and ``--output`` are still read (:mod:`hadpsgd.forward.flags`).

The output is the log-posteriors ``log p(s|x)`` of every frame, or with priors (the run's
``priors.json`` by default) the pseudo-log-likelihoods ``log p(s|x) - log p(s)`` that
Kaldi's ``latgen-faster-mapped`` reads. docs/forward.md has the details and the measurement
behind the default ``--context``. Exit codes: 0 done, 2 a user error (one line naming the
thing and the fix, before any work), 1 a failure while running.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from collections.abc import Sequence

from hadpsgd import comm
from hadpsgd.data import PRIORS_FILE, Priors, load_priors
from hadpsgd.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR
from hadpsgd.forward.average import add_arguments as add_average_arguments
from hadpsgd.forward.average import load_averaged
from hadpsgd.forward.chunks import CONTEXTS
from hadpsgd.forward.features import open_features
from hadpsgd.forward.flags import Parser, add_model, add_out
from hadpsgd.forward.job import (
    Job,
    Options,
    agree,
    check_new,
    check_shapes,
    learn_index,
    log,
    retire_index,
    run,
)
from hadpsgd.forward.model import ForwardError, LoadedModel, describe
from hadpsgd.forward.output import parse_output
from hadpsgd.forward.pipeline import add_arguments as add_cmvn_arguments
from hadpsgd.precision import set_tf32
from hadpsgd.train.progress import on_terminal

DEFAULT_CONTEXT = "whole"
"""The default ``--context`` (docs/forward.md, *Whole utterances or windows*)."""
DEFAULT_OVERLAP = 0
"""The default ``--chunk-overlap``."""


PROG = "python -m hadpsgd.forward"


def parser() -> Parser:
    """The command line."""
    p = Parser(prog=PROG, allow_abbrev=False,
               description="Run a trained BLSTM over features and write per-frame "
                           "log-posteriors or pseudo-log-likelihoods (Kaldi archive or HDF5).")
    add_model(p, PROG)
    p.add_argument("--features", required=True, metavar="FILE.h5|RSPECIFIER",
                   help="a hadpsgd .h5 feature file, or a Kaldi rspecifier read through "
                        "kaldiio (scp:feats.scp, ark:feats.ark, 'ark:cmd |', ark:-)")
    add_out(p, "WSPECIFIER|FILE.h5", "a Kaldi wspecifier (ark:out.ark, ark,scp:out.ark,"
                                     "out.scp, ark:-) or an .h5 file (loglikes, offsets, "
                                     "utt_ids)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output that is already there (default: refuse it, naming "
                        "it); each file is replaced when its new version is complete")
    p.add_argument("--priors", default="auto", metavar="auto|FILE|none",
                   help="auto (default): the run's priors.json if it has one, else none; "
                        "FILE: a priors JSON, a Kaldi text vector of counts, or a training "
                        ".h5 file (its labels counted); none: write log-posteriors")
    p.add_argument("--prior-scale", type=float, default=1.0, metavar="P",
                   help="exponent on the priors: log p(s|x) - P log p(s) (default 1, the "
                        "textbook division; hybrid systems tune P on dev, often 0.3-0.7: "
                        "docs/forward.md)")
    p.add_argument("--context", choices=CONTEXTS, default=DEFAULT_CONTEXT,
                   help=f"whole: each utterance in one pass; chunks: overlapping windows "
                        f"(default {DEFAULT_CONTEXT}, see docs/forward.md)")
    p.add_argument("--chunk-len", type=int, default=None,
                   help="window length of --context chunks (default: the training's "
                        "chunk_len)")
    p.add_argument("--chunk-overlap", type=int, default=DEFAULT_OVERLAP,
                   help="context frames on each side of a window's kept centre "
                        f"(default {DEFAULT_OVERLAP})")
    p.add_argument("--norm", default="auto", metavar="auto|FILE|none",
                   help="normalisation of Kaldi features: auto (default) the training file's "
                        "norm/ statistics, FILE a feature file or .npz (mean, std), none; an "
                        ".h5 input's own norm/ is always applied")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA if available (one GPU per rank on a host)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="autocast of the forward (the softmax is fp32); auto: the training's "
                        "if fp32 or bf16, else fp32")
    p.add_argument("--tf32", action="store_true",
                   help="let fp32 matmuls and cuDNN's LSTM use TF32 on CUDA (off: fp32 is IEEE "
                        "fp32, as in training without --tf32)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it shows on rank 0 when stdout and stderr reach a "
                        "terminal: under mpirun, the launcher's)")
    add_average_arguments(p)  # --avg N, --avg-best N
    add_cmvn_arguments(p)  # --utt2spk, --cmvn: Kaldi input's CMVN
    return p


def resolve_priors(spec: str, loaded: LoadedModel) -> tuple[Priors | None, str]:
    """The priors ``--priors`` names, and one line saying which."""
    if spec == "none":
        return None, "none (--priors none): writing log-posteriors"
    if spec == "auto":
        found = loaded.run_dir / PRIORS_FILE if loaded.run_dir is not None else None
        if found is None or not found.is_file():
            where = f"no {PRIORS_FILE} in {loaded.run_dir}" if loaded.run_dir else \
                "the checkpoint is not in a run directory"
            return None, (f"none ({where}): writing log-posteriors; for pseudo-log-"
                          f"likelihoods pass --priors {loaded.train_file or 'TRAIN.h5'}")
        spec = str(found)
    priors = load_priors(spec)
    return priors, (f"{spec} ({priors.num_classes} classes, {priors.frames:.0f} frames, "
                    "add-one smoothed): writing pseudo-log-likelihoods")


def check_prior_scale(scale: float, priors: Priors | None) -> str:
    """Refuse a ``--prior-scale`` that is not a finite number >= 0, or one without priors.

    Returns:
        What to add to the priors' start-up line: the exponent where it is not 1, else ''.

    Raises:
        ForwardError: Naming the value and what to pass instead.
    """
    if not math.isfinite(scale) or scale < 0:
        raise ForwardError(f"--prior-scale {scale:g}: the priors' exponent must be a finite "
                           "number >= 0 (1 divides by the priors, 0 leaves the posteriors; "
                           "hybrid systems tune it on dev, often 0.3-0.7)")
    if priors is None and scale != 1.0:
        raise ForwardError(f"--prior-scale {scale:g} without priors (--priors none, or none "
                           "found): it scales the priors' logarithm; pass --priors auto|FILE, "
                           "or leave --prior-scale out to write log-posteriors")
    return "" if priors is None or scale == 1.0 else \
        f", the priors to the power {scale:g} (--prior-scale)"


def _precision(flag: str, loaded: LoadedModel) -> str:
    if flag != "auto":
        return flag
    return loaded.precision if loaded.precision in ("fp32", "bf16") else "fp32"


def setup(args: argparse.Namespace, topo: comm.Topology) -> Job:
    """Every check, agreed by every rank, before any work; then the start-up lines."""

    def local() -> tuple[Job, str, str]:
        out = parse_output(args.out)
        if topo.size > 1 and not out.in_files:
            raise ForwardError(f"--out {args.out}: under mpirun every rank writes a part "
                               "of the output, which needs files; write ark,scp:out.ark,"
                               "out.scp or out.h5, or run one process to pipe it")
        check_new(out, topo.size, args.overwrite)
        loaded = load_averaged(args.model, args.avg, args.avg_best)
        priors, priors_line = resolve_priors(args.priors, loaded)
        priors_line += check_prior_scale(args.prior_scale, priors)
        chunk_len = args.chunk_len if args.chunk_len is not None else loaded.chunk_len
        opts = Options(args.context, chunk_len, args.chunk_overlap,
                       _precision(args.precision, loaded),
                       progress=not args.no_progress and on_terminal(),
                       prior_scale=args.prior_scale)
        features, norm_line = open_features(args.features, args.norm, loaded.train_file,
                                            args.utt2spk, args.cmvn)
        return Job(loaded, features, out, priors, opts), priors_line, norm_line

    job, priors_line, norm_line = agree(topo, local)
    set_tf32(topo.device, args.tf32)  # process-wide; decided here, not left to torch's default
    loaded, features, opts = job.loaded, job.features, job.opts
    learn_index(topo, features)
    agree(topo, lambda: check_shapes(loaded, features, job.priors))
    if args.overwrite:
        retire_index(topo, job.out)
    if topo.rank == 0:
        log(f"model: {describe(loaded)}")
        log(f"features: {features.name}, normalisation {norm_line}")
        log(f"priors: {priors_line}")
        tf32 = (" (TF32 allowed: --tf32)" if args.tf32 else " (no TF32)") \
            if topo.device.type == "cuda" and opts.precision == "fp32" else ""
        log(f"context: {opts.describe()}, {opts.precision}{tf32} on {topo.size} rank(s), "
            f"{topo.device}")
    return job


def _fail(err: BaseException, topo: comm.Topology) -> int:
    """Report ``err`` from this rank and end the job (every rank of it).

    Exit 2 for a user's error found while running (a bad utterance), 1 for anything else
    (with its traceback).
    """
    user = isinstance(err, ForwardError)
    if not user and not isinstance(err, KeyboardInterrupt):
        traceback.print_exception(err)
    prefix = f"rank {topo.rank}: " if topo.size > 1 else ""
    print(f"hadpsgd.forward: {prefix}error: {err}", file=sys.stderr, flush=True)
    code = EXIT_USER_ERROR if user else EXIT_FAILED
    if topo.size > 1:
        topo.abort(code)  # the peers may wait in a collective this rank never joins
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parser().parse_args(argv)
    try:
        topo = comm.init(device=args.device, intra_backend="mpi")
    except comm.TopologyError as err:
        print(f"hadpsgd.forward: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        job = setup(args, topo)
    except ForwardError as err:  # every rank found it (agree): all end alike, one line
        if topo.rank == 0:
            print(f"hadpsgd.forward: error: {err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except BaseException as err:  # noqa: BLE001 - reported, then the whole job ends
        return _fail(err, topo)
    try:
        summary = run(topo, job)
    except BaseException as err:  # noqa: BLE001 - reported, then the whole job ends
        return _fail(err, topo)
    if topo.rank == 0:
        rate = summary["frames"] / max(summary["seconds"], 1e-9)
        log(f"wrote {summary['utterances']} utterances, {summary['frames']} frames to "
            f"{', '.join(map(str, summary['files']))} in {summary['seconds']:.1f} s "
            f"({rate:,.0f} frames/s)")
    topo.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
