"""Sites as a level: the main command on two emulated sites, the slow link between them counted.

Two sites of hosts (:class:`benchmarks._common.sites.Sites`: a network namespace a host, one
switch, the link between the sites throttled and the sites' own networks not), one rank a
host, each configuration run once through ``python -m hadpsgd.run`` for ``--steps``. The
queues' counters give the bytes that crossed *between* the sites and *inside* them; beside
them the run's own count of what crossed between its super-learners, the run's seconds, and
ratios against SSGD fp32 over the same hosts measured in the same invocation (its every
step's mean crosses the slow link). The site configurations put each site in one
super-learner (``--ranks-per-node`` = a site's ranks): SSGD inside a site, BMUF or H-ADPSGD
between sites; ``bmuf-hosts`` is BMUF with every host its own worker, for comparison.
Usage::

    python -m benchmarks.training.sites [--configs ssgd bmuf-sites ...] [--steps 60] \
        [--rate 100mbit] [--hosts-per-site 2] [--json out.json] [-- extra hadpsgd.run flags]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit
from benchmarks._common.sites import Sites
from benchmarks.training.link import ratio, run_one, split_extra


def configs(per_site: int) -> dict[str, list[str]]:
    """The runs, by name: flags of ``hadpsgd.run`` for sites of ``per_site`` ranks."""
    site = ["--ranks-per-node", str(per_site)]
    return {
        "ssgd": ["--algo", "ssgd"],
        "bmuf-hosts": ["--algo", "bmuf", "--ranks-per-node", "1"],
        "bmuf-sites": ["--algo", "bmuf", *site],
        "bmuf-sign-sites": ["--algo", "bmuf", "--wire", "sign", *site],
        "hadpsgd-sites": ["--algo", "adpsgd", "--super-learner-size", str(per_site)],
    }


def row(name: str, flags: list[str], run: dict[str, Any]) -> dict[str, Any]:
    """A configuration's figures from one run of :func:`benchmarks.training.link.run_one`."""
    between, inside = run["link_bytes_each_way"]
    c = run["counted"]
    return {"config": name, "flags": flags, "steps": run["steps"], "seconds": run["seconds"],
            "between_sites": between, "inside_sites": inside,
            "counted_between_super_learners": c.get("world_internode_bytes", 0.0)
            + c.get("world_control_bytes", 0.0), "last_line": run["last_line"]}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's bytes between sites and seconds against SSGD's."""
    ref = next((r for r in rows if r["config"] == "ssgd"), None)
    for r in rows:
        r["ssgd_over_between_sites"] = (ref["between_sites"] / r["between_sites"]
                                        if ref is not None and r["between_sites"] else None)
        r["ssgd_over_seconds"] = ref["seconds"] / r["seconds"] if ref is not None else None


def table(rows: list[dict[str, Any]]) -> str:
    """The stdout table: one line per configuration."""
    lines = [f"{'config':<16} {'between sites':>14} {'vs ssgd':>8} {'inside sites':>13} "
             f"{'run counted':>12} {'seconds':>8} {'vs ssgd':>8}"]
    for r in rows:
        lines.append(f"{r['config']:<16} {r['between_sites']:>14,} "
                     f"{ratio(r['ssgd_over_between_sites']):>8} {r['inside_sites']:>13,} "
                     f"{r['counted_between_super_learners']:>12,.0f} {r['seconds']:>8.1f} "
                     f"{ratio(r['ssgd_over_seconds']):>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration on two emulated sites; print the table and the JSON record."""
    argv, extra = split_extra(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(configs(2)), choices=list(configs(2)))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rate", default="100mbit", help="the inter-site link's rate each way")
    p.add_argument("--hosts-per-site", type=int, default=2)
    p.add_argument("--preset", default="small")
    p.add_argument("--json", type=Path, help="also write the JSON record here")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    a = p.parse_args(argv)
    hosts = 2 * a.hosts_per_site
    rows = []
    with Sites(sites=2, hosts_per_site=a.hosts_per_site, rate=a.rate) as sites:
        for name in a.configs:
            flags = [*configs(a.hosts_per_site)[name], "--preset", a.preset, *extra]
            rows.append(row(name, flags, run_one(sites, flags, a.steps, hosts, a.timeout)))
            print(f"# {name}: {rows[-1]['last_line']}", flush=True)
    add_ratios(rows)
    print(f"{hosts} ranks on 2 emulated sites of {a.hosts_per_site} hosts (between the sites "
          f"{a.rate}, inside unthrottled), --preset {a.preset}, {a.steps} steps "
          f"{' '.join(extra)}")
    print(table(rows))
    emit({"benchmark": "sites", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "cpus": os.cpu_count(), "rate": a.rate, "hosts_per_site": a.hosts_per_site,
          "steps": a.steps, "extra": extra, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
