"""Calibrate the cost model on this machine: links from ``benchmarks.comm`` JSON, compute by timing.

The comm benchmark's JSON record (``python -m benchmarks.comm ... --json FILE``) has one row per
op and message size with ``name``, ``op``, ``backend``, ``size_bytes``, ``nranks`` and
``time_us`` (the maximum over ranks of the mean time of one op). The links are fitted by
least squares over the sizes (:func:`lab.projection.costmodel.fit_alpha_beta`):

- intra-node: the ``intra/<backend>`` rows of the backend the topology used (``--op intra``),
  as ring allreduces over the node's ranks; without them, the ``allreduce/flat`` rows of a
  one-host run (every rank on one host: the same shared-memory path);
- inter-node: the ``allreduce/flat`` rows as ring allreduces over all ranks; without them the
  ``exchange`` rows as pair exchanges.

On one host both levels are shared-memory MPI: the "inter-node" link is then that of a
hypothetical network as fast as this host's MPI, and the record says so.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common.timing import step_times, training_step
from lab.projection.costmodel import Link, fit_alpha_beta, fit_error, ring_coefficients


@dataclass
class LinkFit:
    """A fitted link and what it was fitted on."""

    link: Link
    """The fitted alpha and beta."""
    source: str
    """Which rows: e.g. ``intra/mpi (ring, p=2,4)``."""
    rows: int
    """Number of measurements."""
    rms_rel_error: float
    """Root-mean-square relative error of the fit over those rows."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (alpha in microseconds, bandwidth in GB/s)."""
        return {"alpha_us": self.link.alpha * 1e6, "beta_s_per_byte": self.link.beta,
                "gbps": self.link.gbps, "source": self.source, "rows": self.rows,
                "rms_rel_error": self.rms_rel_error}


@dataclass
class Calibration:
    """Both levels fitted from one or more comm JSON files."""

    intra: LinkFit
    """The in-node link."""
    inter: LinkFit
    """The between-node link."""
    files: list[str] = field(default_factory=list)
    """The JSON files read."""
    notes: list[str] = field(default_factory=list)
    """Fallbacks taken and caveats."""


def load_comm_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Read comm benchmark records, skipping files that are not one (named in the error).

    Raises:
        ValueError: If a file is not JSON or has no ``rows``.
    """
    records = []
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable comm benchmark JSON ({err})") from err
        if not isinstance(record, dict) or record.get("benchmark") != "comm" or "rows" not in \
                record:
            raise ValueError(f"{path}: not a benchmarks.comm record (no 'rows'); write one "
                             "with python -m benchmarks.comm --json FILE")
        record["_path"] = str(path)
        records.append(record)
    return records


def _fit_ring(rows: Sequence[dict[str, Any]], label: str) -> LinkFit:
    sizes = [r["size_bytes"] for r in rows]
    ranks = [r["nranks"] for r in rows]
    times = [r["time_us"] * 1e-6 for r in rows]
    lat, byt = ring_coefficients(sizes, ranks)
    link = fit_alpha_beta(lat, byt, times)
    ps = ",".join(str(p) for p in sorted(set(ranks)))
    return LinkFit(link, f"{label} (ring allreduce, p={ps})", len(rows),
                   fit_error(link, lat, byt, times))


def _fit_pair(rows: Sequence[dict[str, Any]], label: str) -> LinkFit:
    times = [r["time_us"] * 1e-6 for r in rows]
    lat = [1.0] * len(rows)
    byt = [float(r["size_bytes"]) for r in rows]
    link = fit_alpha_beta(lat, byt, times)
    return LinkFit(link, f"{label} (pair exchange)", len(rows), fit_error(link, lat, byt, times))


def calibrate(records: Sequence[dict[str, Any]]) -> Calibration:
    """Fit the intra- and inter-node links from comm benchmark records (see the module doc).

    Raises:
        ValueError: If the records hold no usable rows at all.
    """
    intra_rows, flat_rows, flat_one_host, pair_rows = [], [], [], []
    one_host = True
    for rec in records:
        topo = rec.get("topology", {})
        hosts = topo.get("hosts", 1)
        one_host = one_host and hosts == 1
        backend = topo.get("intra_backend")
        for r in rec["rows"]:
            if not r.get("time_us") or r.get("nranks", 0) < 2:
                continue
            if r["op"] == "intra" and r.get("backend") == backend:
                intra_rows.append(r)
            elif r.get("name") == "allreduce/flat":
                flat_rows.append(r)
                if hosts == 1:
                    flat_one_host.append(r)
            elif r["op"] == "exchange":
                pair_rows.append(r)
    notes: list[str] = []
    intra = inter = None
    if intra_rows:
        intra = _fit_ring(intra_rows, "intra/" + str(intra_rows[0].get("backend")))
    elif flat_one_host:
        intra = _fit_ring(flat_one_host, "allreduce/flat on one host")
        notes.append("intra-node link fitted on one-host allreduce/flat rows (no --op intra "
                     "rows given)")
    if flat_rows:
        inter = _fit_ring(flat_rows, "allreduce/flat")
    elif pair_rows:
        inter = _fit_pair(pair_rows, "exchange")
    if intra is None and inter is None:
        raise ValueError("no usable rows (intra, allreduce/flat or exchange with >= 2 ranks) "
                         "in the comm JSON files")
    if intra is None:
        intra = inter
        notes.append("no intra-node rows: the intra-node link is the inter-node fit")
    if inter is None:
        inter = intra
        notes.append("no allreduce/flat or exchange rows: the inter-node link is the "
                     "intra-node fit")
    if one_host:
        notes.append("measured on one host: the 'inter-node' link is this host's MPI "
                     "(shared memory), i.e. a network as fast as that")
    assert intra is not None and inter is not None
    return Calibration(intra, inter, [r["_path"] for r in records if "_path" in r], notes)


def default_comm_files(directory: Path = Path("bench-results")) -> list[Path]:
    """Every ``comm*.json`` under ``directory`` (the comm benchmark's default output place)."""
    return sorted(directory.glob("comm*.json")) if directory.is_dir() else []


def measure_compute(preset: str, batch: int, feat_dim: int = 260, num_classes: int = 64,
                    chunk_len: int = 21, steps: int = 5, warmup: int = 2,
                    threads: int | None = 1) -> tuple[float, int]:
    """Median seconds of one forward/backward/SGD update of ``preset`` at ``batch``, and its size.

    Uses random features (the cost of a step does not depend on the values).

    Args:
        preset: Model preset (``tiny``, ``small``, ``swb``).
        batch: Sub-sequences per step (the per-learner batch).
        feat_dim: Input features per frame.
        num_classes: Output classes.
        chunk_len: Frames per sub-sequence.
        steps: Timed steps (the median is returned).
        warmup: Untimed steps first.
        threads: Torch threads while timing (default 1: one learner per core, as when a node's
            cores are shared by its learners); ``None`` keeps the current setting.

    Returns:
        ``(seconds per step, parameter count)``.
    """
    import torch

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _time_steps(preset, batch, feat_dim, num_classes, chunk_len, steps, warmup)
    finally:
        torch.set_num_threads(old_threads)


def _time_steps(preset: str, batch: int, feat_dim: int, num_classes: int, chunk_len: int,
                steps: int, warmup: int) -> tuple[float, int]:
    import torch

    from hadpsgd.models import build_model, count_parameters

    torch.manual_seed(0)
    model = build_model(preset, feat_dim, num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, chunk_len, feat_dim)
    y = torch.randint(0, num_classes, (batch, chunk_len))
    times = step_times(training_step(model, opt, x, y, num_classes), steps, warmup=warmup)
    # The median: another process on a shared machine can stall any one step.
    return statistics.median(times), count_parameters(model)
