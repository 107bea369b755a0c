"""The model and output arguments, spelled one way across the inference commands.

``python -m hadpsgd.export RUN --out F``, ``hadpsgd.plot RUN --out F``, ``hadpsgd.data.kaldi
--out F``: the model (or run) is the first argument and the file written is ``--out``, so
``python -m hadpsgd.forward RUN --features X --out F`` is spelled the same. Forward's older
``--model RUN`` and ``--output F`` are still read (scripts and docs of earlier releases use
them), hidden from ``--help`` but named in the help of the spelling that replaced them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

MODEL_METAVAR = "RUN_DIR|CHECKPOINT_DIR"
MODEL_HELP = ("a run directory (its newest valid checkpoint) or a checkpoint directory "
              "(RUN/checkpoints/step-NNNNNNNN)")


class Parser(argparse.ArgumentParser):
    """An argument parser that also requires the arguments spelled two ways.

    argparse's ``required`` holds for one spelling only; an argument that may come as the
    first argument or as ``--model`` (or as ``--out`` or ``--output``) is checked here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._needed: list[tuple[str, str]] = []

    def need(self, dest: str, message: str) -> None:
        """Fail with ``message`` when no spelling of ``dest`` is given."""
        self._needed.append((dest, message))

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, then every :meth:`need` checked (an error exits 2, naming it)."""
        ns, rest = super().parse_known_args(args, namespace)
        for dest, message in self._needed:
            if getattr(ns, dest, None) is None:
                self.error(message)
        return ns, rest


def add_model(p: Parser, command: str) -> None:
    """The model: the first argument, or ``--model`` (forward's older spelling).

    Args:
        p: The command's parser.
        command: The command line's start, for the message when it is missing.
    """
    # SUPPRESS: an absent first argument leaves what --model set alone.
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar=MODEL_METAVAR,
                   help=MODEL_HELP + " (also read as --model RUN_DIR, forward's older "
                        "spelling)")
    p.add_argument("--model", dest="model", default=None, metavar=MODEL_METAVAR,
                   help=argparse.SUPPRESS)
    p.need("model", f"name the model to run: {command} RUN_DIR ..., a run directory or one "
                    "of its checkpoints")


def add_out(p: Parser, metavar: str, help_text: str,
            kind: Callable[[str], Any] = str) -> None:
    """The file to write: ``--out``, or ``--output`` (forward's older spelling).

    Args:
        p: The command's parser.
        metavar: What ``--out`` takes, for the help.
        help_text: Its help.
        kind: argparse's ``type`` of the value.
    """
    p.add_argument("--out", dest="out", default=None, type=kind, metavar=metavar,
                   help=help_text + " (also read as --output, forward's older spelling)")
    p.add_argument("--output", dest="out", default=None, type=kind, help=argparse.SUPPRESS)
    p.need("out", f"the following arguments are required: --out {metavar} (the file to "
                  "write)")
