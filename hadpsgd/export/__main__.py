"""``python -m hadpsgd.export``: a checkpoint's model as TorchScript or ONNX, checked.

    python -m hadpsgd.export RUN_DIR --format onnx --out model.onnx
    python -m hadpsgd.export RUN_DIR --avg-best 3 --format torchscript --out model.pt

The exported graph takes raw features ``[batch, time, feat_dim]`` float32 (the training's
normalisation baked in, as ``hadpsgd.forward`` applies it) and returns what forward writes:
log-posteriors, or with priors pseudo-log-likelihoods (:mod:`hadpsgd.export.graph`). The
written file is then run as a user runs it (``torch.jit.load``, onnxruntime) against the
checkpoint's own PyTorch model on random inputs of two shapes (:mod:`hadpsgd.export.check`).
docs/export.md has the details. Exit codes: 0 written and checked, 1 the check failed (the
file is not written) or a failure while exporting, 2 a user error (one line naming the thing
and the fix, before any work).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hadpsgd.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR
from hadpsgd.export.check import TOLERANCE, check
from hadpsgd.export.formats import (
    FORMATS,
    INSTALL,
    ONNX_OPSET,
    SUFFIXES,
    load,
    missing_for,
    runtime,
    save,
)
from hadpsgd.export.graph import INPUT_NAME, Deployable
from hadpsgd.export.inputs import resolve
from hadpsgd.forward import ForwardError
from hadpsgd.forward.average import add_arguments as add_average_arguments
from hadpsgd.forward.average import load_averaged
from hadpsgd.forward.flags import Parser, add_model, add_out
from hadpsgd.forward.model import describe
from hadpsgd.forward.output import writable


def _tolerance(text: str) -> float:
    """``--tolerance``: a finite number >= 0 (NaN or a negative one would fail every check)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (the largest absolute "
                                         f"difference accepted), got {text!r}")
    return value


def parser() -> Parser:
    """The command line."""
    prog = "python -m hadpsgd.export"
    p = Parser(prog=prog, allow_abbrev=False,
               description="Export a trained BLSTM (raw features in, per-frame log-posteriors "
                           "or pseudo-log-likelihoods out) to TorchScript or ONNX, and check "
                           "the file against the checkpoint.")
    add_model(p, prog)  # the first argument, as forward's (--model read too)
    add_out(p, "FILE", "the file to write (.onnx, or .pt for TorchScript)", Path)
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="torchscript or onnx (default: from --out's suffix: "
                        f"{', '.join(SUFFIXES)})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is there (default: refuse it)")
    p.add_argument("--priors", default="auto", metavar="auto|FILE|none",
                   help="as hadpsgd.forward's: auto (default) the run's priors.json if it has "
                        "one (pseudo-log-likelihoods), else none (log-posteriors); FILE a "
                        "priors JSON, Kaldi vector of counts or training .h5")
    p.add_argument("--prior-scale", type=float, default=1.0, metavar="P",
                   help="as hadpsgd.forward's: the priors' exponent baked into the graph, "
                        "log p(s|x) - P log p(s) (default 1)")
    p.add_argument("--norm", default="auto", metavar="auto|FILE|none",
                   help="the normalisation baked into the graph: auto (default) the training "
                        "file's norm/ statistics, FILE a feature file or .npz (mean, std), "
                        "none (the graph then takes normalised features)")
    p.add_argument("--tolerance", type=_tolerance, default=TOLERANCE,
                   help=f"largest absolute difference of a score the check accepts "
                        f"(default {TOLERANCE:g})")
    add_average_arguments(p)  # --avg N, --avg-best N
    return p


def log(message: str) -> None:
    """A status line."""
    print(f"[hadpsgd.export] {message}", flush=True)


def _format(args: argparse.Namespace) -> str:
    if args.format is not None:
        return str(args.format)
    fmt = SUFFIXES.get(args.out.suffix.lower())
    if fmt is None:
        raise ForwardError(f"--out {args.out}: its suffix does not tell the format; pass "
                           "--format torchscript or --format onnx (or name it .pt or .onnx)")
    return fmt


def _check_out(out: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise ForwardError(f"--out {out} is a directory; name a file")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ForwardError(f"--out {out} already exists; pass --overwrite to replace it, or "
                           "write elsewhere")
    if not out.parent.is_dir():
        raise ForwardError(f"--out {out}: the directory {out.parent} does not exist; make it "
                           "first")
    if not writable(out.parent):
        raise ForwardError(f"--out {out}: the directory {out.parent} is not writable; write "
                           "elsewhere or fix its permissions")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parser().parse_args(argv)
    try:
        fmt = _format(args)
        missing = missing_for(fmt)
        if missing is not None:
            print(f"hadpsgd.export: error: --format {fmt} needs {missing}, which is not "
                  f"installed: {INSTALL}", file=sys.stderr)
            return EXIT_USER_ERROR
        _check_out(args.out, args.overwrite)
        loaded = load_averaged(args.model, args.avg, args.avg_best)
        scores, norm_line, priors_line = resolve(args.norm, args.priors, loaded,
                                                   args.prior_scale)
    except ForwardError as err:
        print(f"hadpsgd.export: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    log(f"model: {describe(loaded)}")
    log(f"normalisation: {norm_line}")
    log(f"priors: {priors_line}")
    info = {"producer": "hadpsgd.export", "model": loaded.source, "preset":
            loaded.config["model"]["preset"], "input": f"{INPUT_NAME} [batch, time, "
            f"{loaded.input_dim}] float32, raw", "output": f"{scores.output_name} [batch, "
            f"time, {loaded.num_classes}]", "normalisation": norm_line, "priors": priors_line}
    tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
    try:
        start = time.perf_counter()
        save(fmt, Deployable(loaded, scores), tmp, info, scores.output_name)
        took = time.perf_counter() - start
        what = f"ONNX opset {ONNX_OPSET}" if fmt == "onnx" else "TorchScript"
        log(f"exported {what}, {tmp.stat().st_size / 2**20:.1f} MiB, in {took:.1f} s: "
            f"{INPUT_NAME} [batch, time, {loaded.input_dim}] -> {scores.output_name} "
            f"[batch, time, {loaded.num_classes}], batch and time dynamic")
        result = check(load(fmt, tmp), loaded, scores, args.tolerance)
        log(f"check ({runtime(fmt)} against the checkpoint's PyTorch model, random raw "
            f"features): " + "; ".join(f.describe() for f in result.figures))
        if not result.passed:
            print(f"hadpsgd.export: error: the exported model differs from the checkpoint's: "
                  f"max abs difference {result.max_abs:.3g} > tolerance {args.tolerance:g}; "
                  f"{args.out} was not written", file=sys.stderr)
            return EXIT_FAILED
        os.replace(tmp, args.out)
    except Exception:
        import traceback

        traceback.print_exc()
        print(f"hadpsgd.export: error: exporting to {args.out} failed (above); nothing was "
              "written", file=sys.stderr)
        return EXIT_FAILED
    finally:
        tmp.unlink(missing_ok=True)
    log(f"wrote {args.out}: max abs difference {result.max_abs:.2e} <= tolerance "
        f"{args.tolerance:g}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
