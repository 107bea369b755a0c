"""The two formats: writing the graph, and running the written file as a user would.

TorchScript (``torch.jit.script``: the graph is compiled, so batch and time are dynamic by
construction) is read back with ``torch.jit.load``. ONNX goes through torch's TorchScript-based
exporter (``dynamo=False``: it exports the LSTM as one ONNX ``LSTM`` node per layer and needs
no ``onnxscript``), with the batch and time axes declared dynamic, and is read back with
onnxruntime. Both files carry a description of what they compute (:func:`metadata`): the
ONNX file in its ``metadata_props``, the TorchScript file as the extra file
``hadpsgd.json``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata as dist
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hadpsgd.export.graph import INPUT_NAME, Deployable

FORMATS = ("torchscript", "onnx")
"""The values of ``--format``."""
SUFFIXES = {".onnx": "onnx", ".pt": "torchscript", ".ts": "torchscript", ".jit": "torchscript"}
"""``--out``'s suffixes that tell the format when ``--format`` is not given."""
ONNX_OPSET = 17
"""The ONNX opset written (onnxruntime has run it since 1.11)."""
EXTRA_FILE = "hadpsgd.json"
"""The TorchScript file's description (``torch.jit.load(..., _extra_files=...)``)."""
INSTALL = "pip install 'hadpsgd[export]' (or pip install onnx onnxruntime)"
"""How to get what ``--format onnx`` needs."""

Runner = Callable[[np.ndarray], np.ndarray]
"""An exported file, loaded: ``[batch, time, feat_dim]`` float32 in, scores out."""


def missing_for(fmt: str) -> str | None:
    """The packages ``fmt`` needs that are not installed, as a phrase, or None."""
    if fmt != "onnx":
        return None
    missing = []
    for name in ("onnx", "onnxruntime"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return " and ".join(missing) or None


def runtime(fmt: str) -> str:
    """What runs the exported file, with its version (``onnxruntime 1.20.1``)."""
    name = "onnxruntime" if fmt == "onnx" else "torch"
    try:
        return f"{name} {dist.version(name)}"
    except dist.PackageNotFoundError:
        return name


def metadata(info: dict[str, Any]) -> dict[str, str]:
    """``info`` as string pairs, for the file's description."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporters' warnings that the check answers.

    torch 2.9+ marks TorchScript and the TorchScript-based ONNX exporter deprecated (both
    still work, and the check runs what they wrote); the tracer warns that the LSTM's shape
    checks become constants and that an LSTM exported at batch 2 may fail at another batch:
    the check runs batches of 1 and 3 and other lengths.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*batch_size other than 1.*")
        yield


def save_torchscript(graph: Deployable, path: Path, info: dict[str, Any]) -> None:
    """Compile ``graph`` with TorchScript and save it to ``path``."""
    with _quiet():
        scripted = torch.jit.script(graph)
        torch.jit.save(scripted, str(path),
                       _extra_files={EXTRA_FILE: json.dumps(metadata(info), indent=1)})


def save_onnx(graph: Deployable, path: Path, info: dict[str, Any], output: str) -> None:
    """Export ``graph`` to ONNX at ``path``, its batch and time axes dynamic."""
    import onnx

    example = torch.zeros(2, 50, graph.lstm.input_size)
    axes = {0: "batch", 1: "time"}
    with _quiet():
        torch.onnx.export(graph, (example,), str(path), dynamo=False, opset_version=ONNX_OPSET,
                          input_names=[INPUT_NAME], output_names=[output],
                          dynamic_axes={INPUT_NAME: axes, output: axes})
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    for key, value in metadata(info).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))


def save(fmt: str, graph: Deployable, path: Path, info: dict[str, Any], output: str) -> None:
    """Write ``graph`` to ``path`` in ``fmt``."""
    if fmt == "onnx":
        save_onnx(graph, path, info, output)
    else:
        save_torchscript(graph, path, info)


def load(fmt: str, path: Path) -> Runner:
    """The exported file at ``path``, loaded as a user would load it, on the CPU."""
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def run_onnx(feats: np.ndarray) -> np.ndarray:
            return np.asarray(session.run(None, {INPUT_NAME: feats})[0])

        return run_onnx
    with _quiet():
        module = torch.jit.load(str(path), map_location="cpu")

    @torch.no_grad()
    def run_script(feats: np.ndarray) -> np.ndarray:
        return module(torch.from_numpy(feats)).numpy()

    return run_script
