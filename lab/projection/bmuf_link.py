"""The cost model's network link fitted to a measured BMUF run over a real (emulated) link.

``benchmarks/bmuf.py --two-hosts RATE --json F`` measures, in one job, the step time of
local-only training, blocking BMUF and its overlapped / compressed variants over a throttled
TCP link between two network namespaces. This module fits the model's inter-node link to the
blocking row (the block sync's time per byte: ``beta``), then predicts every other BMUF row
with :func:`lab.projection.costmodel.step_time`'s formulas and sets the prediction
beside the measurement. Where they agree, the same formulas on the papers' cluster (with its
compute step, model size and network) say what the variants would buy there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab.projection.costmodel import INT8_WIRE_RATIO


def _variant(mode: str) -> tuple[int, bool, float]:
    """``bmuf-tau8+overlap+int8`` -> ``(8, True, wire ratio)``."""
    head, *opts = mode.split("+")
    ratio = INT8_WIRE_RATIO if "int8" in opts else (0.5 if "bf16" in opts else 1.0)
    return int(head[len("bmuf-tau"):]), "overlap" in opts, ratio


def fit(record: dict[str, Any]) -> dict[str, Any]:
    """Fit the link on the blocking BMUF rows and predict every BMUF row.

    Args:
        record: The JSON record of ``benchmarks/bmuf.py`` (two nodes).

    Returns:
        ``beta_s_per_byte`` (fitted), ``gbit_s`` (its rate) and ``rows``: per BMUF mode the
        measured and predicted seconds per step and fraction of local-only throughput.

    Raises:
        ValueError: Without a local-only row or a blocking BMUF row with traffic.
    """
    rows = {r["mode"]: r for r in record["rows"]}
    if "local" not in rows:
        raise ValueError("the record has no local-only row")
    local = rows["local"]["sec_per_step"]
    blocking = [r for m, r in rows.items() if m.startswith("bmuf-tau") and "+" not in m
                and r["inter_bytes_per_step"] and r["sec_per_step"] > local]
    if not blocking:
        raise ValueError("the record has no blocking BMUF row slower than local-only")
    # Exposed time per step = beta * bytes per step (alpha is negligible at these sizes).
    beta = (sum(r["sec_per_step"] - local for r in blocking)
            / sum(r["inter_bytes_per_step"] for r in blocking))
    out = []
    for mode, r in rows.items():
        if not mode.startswith("bmuf-tau"):
            continue
        tau, overlap, ratio = _variant(mode)
        fp32_bytes = r["inter_bytes_per_step"] / ratio  # what fp32 would send per step
        block = beta * fp32_bytes * ratio * tau
        predicted = local + (max(0.0, block - tau * local) / tau if overlap else block / tau)
        out.append({"mode": mode, "measured_s": r["sec_per_step"], "predicted_s": predicted,
                    "measured_vs_local": local / r["sec_per_step"],
                    "predicted_vs_local": local / predicted})
    return {"beta_s_per_byte": beta, "gbit_s": 8e-9 / beta, "local_s": local, "rows": out}


def format_fit(result: dict[str, Any], source: Path) -> str:
    """The stdout table of :func:`fit`."""
    lines = [f"# BMUF over the measured link ({source}): fitted {result['gbit_s']:.3f} Gbit/s "
             f"(beta {result['beta_s_per_byte'] * 1e9:.2f} ns/byte), local step "
             f"{result['local_s'] * 1e3:.1f} ms",
             f"#{'mode':>28} {'measured s':>11} {'model s':>9} {'measured':>9} {'model':>7}"]
    for r in result["rows"]:
        lines.append(f" {r['mode']:>28} {r['measured_s']:>11.4f} {r['predicted_s']:>9.4f} "
                     f"{r['measured_vs_local']:>9.2f} {r['predicted_vs_local']:>7.2f}")
    return "\n".join(lines)


def load(path: Path) -> dict[str, Any]:
    """A ``benchmarks/bmuf.py`` JSON record (the last JSON line of a file, or the file)."""
    text = path.read_text().strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1])


__all__ = ["fit", "format_fit", "load"]
