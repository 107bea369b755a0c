"""The alpha-beta cost model, its fit and the projection CLI, against hand-computed values."""

import json
import math

import numpy as np
import pytest

from lab.projection import project
from lab.projection.calibrate import calibrate
from lab.projection.costmodel import (
    ALGOS,
    Cluster,
    Link,
    broadcast,
    fit_alpha_beta,
    fit_error,
    hierarchical_allreduce,
    layout,
    pair_exchange,
    ring_allgather,
    ring_allreduce,
    ring_coefficients,
    speedup,
    step_time,
)

INTRA = Link(alpha=2e-6, beta=1e-11)  # 100 GB/s
INTER = Link(alpha=20e-6, beta=1e-10)  # 10 GB/s
N = 1e8  # bytes


def cluster(compute: float = 0.1, rpn: int = 8, nbytes: float = N) -> Cluster:
    return Cluster("test", INTRA, INTER, rpn, compute, int(nbytes))


# ---------------------------------------------------------------------------- collectives
def test_ring_allreduce_formula():
    # 2(p-1)/p * n * beta + 2(p-1) * alpha, by hand for p = 4: 1.5 * 1e8 * 1e-10 + 6 * 20e-6
    assert ring_allreduce(N, 4, INTER) == pytest.approx(0.015 + 120e-6)
    assert ring_allreduce(N, 2, INTER) == pytest.approx(1.0 * N * 1e-10 + 2 * 20e-6)
    assert ring_allreduce(N, 1, INTER) == 0.0


def test_allgather_broadcast_and_pair():
    assert ring_allgather(N, 4, INTER) == pytest.approx(ring_allreduce(N, 4, INTER) / 2)
    assert broadcast(N, 8, INTRA) == pytest.approx(7 * 2e-6 + N * 1e-11)
    assert broadcast(N, 1, INTRA) == 0.0
    assert pair_exchange(N, INTER) == pytest.approx(20e-6 + 0.01)


def test_layout():
    assert layout(1, 8) == (1, 1)
    assert layout(4, 8) == (4, 1)
    assert layout(8, 8) == (8, 1)
    assert layout(64, 8) == (8, 8)
    with pytest.raises(ValueError, match="equally"):
        layout(12, 8)
    with pytest.raises(ValueError):
        layout(0, 8)


def test_hierarchical_allreduce_by_hand():
    # 16 learners on 2 nodes of 8: intra ring over 8 + inter ring over 2 nodes.
    intra = 14 * 2e-6 + 14 / 8 * N * 1e-11
    inter = 2 * 20e-6 + 1.0 * N * 1e-10
    assert hierarchical_allreduce(N, 16, 8, INTRA, INTER) == pytest.approx(intra + inter)
    # Within one node only the intra-node ring is paid.
    assert hierarchical_allreduce(N, 4, 8, INTRA, INTER) == pytest.approx(
        ring_allreduce(N, 4, INTRA))
    assert hierarchical_allreduce(N, 1, 8, INTRA, INTER) == 0.0


def test_link_rejects_negative():
    with pytest.raises(ValueError):
        Link(alpha=-1.0, beta=0.0)
    assert Link(0.0, 1e-9).gbps == pytest.approx(1.0)
    assert math.isinf(Link(0.0, 0.0).gbps)


# ---------------------------------------------------------------------------- step times
def test_ssgd_step():
    c = cluster()
    cost = step_time("ssgd", 16, c)
    assert cost.total_s == pytest.approx(0.1 + hierarchical_allreduce(N, 16, 8, INTRA, INTER))
    assert cost.compute_s == 0.1 and cost.exchanges_per_step is None


def test_bmuf_step():
    c = cluster()
    # 64 learners, 8 nodes of 8, tau 8, 3 buffers: intra ring every step, block sync / tau.
    grad = 14 * 2e-6 + 14 / 8 * N * 1e-11
    block = (14 * 20e-6 + 14 / 8 * 3 * N * 1e-10) + (7 * 2e-6 + 7 / 8 * 3 * N * 1e-11)
    cost = step_time("bmuf", 64, c, sync_period=8, sync_buffers=3)
    assert cost.total_s == pytest.approx(0.1 + grad + block / 8)
    # One node: no block sync across nodes at all.
    assert step_time("bmuf", 8, c).total_s == pytest.approx(0.1 + grad)
    # A longer block means less communication per step.
    assert step_time("bmuf", 64, c, sync_period=32).total_s < cost.total_s
    with pytest.raises(ValueError):
        step_time("bmuf", 64, c, sync_period=0)


def test_h_adpsgd_step_exchange_hidden():
    c = cluster(compute=0.1)
    base = 0.1 + ring_allreduce(N, 8, INTRA)
    bcast = broadcast(N, 8, INTRA)
    cost = step_time("h-adpsgd", 64, c)
    # The exchange (0.01 s) fits in a step: one per step, only the broadcast is exposed.
    assert pair_exchange(N, INTER) < base
    assert cost.total_s == pytest.approx(base + bcast)
    assert cost.exchanges_per_step == 1.0
    assert cost.hidden_comm_s == pytest.approx(pair_exchange(N, INTER))


def test_h_adpsgd_step_exchange_slower_than_compute():
    c = cluster(compute=1e-3)
    base = 1e-3 + ring_allreduce(N, 8, INTRA)
    bcast = broadcast(N, 8, INTRA)
    x = pair_exchange(N, INTER)
    cost = step_time("h-adpsgd", 16, c)
    # T = base + (T / x) * bcast  =>  T = base / (1 - bcast / x)
    assert cost.total_s == pytest.approx(base / (1 - bcast / x))
    assert cost.exchanges_per_step == pytest.approx(cost.total_s / x)
    assert cost.exchanges_per_step < 1


def test_adpsgd_flat_step_never_waits():
    c = cluster(compute=0.05)
    cost = step_time("adpsgd", 64, c)
    assert cost.total_s == 0.05 and cost.exposed_comm_s == 0.0
    x = (pair_exchange(N, INTRA) + pair_exchange(2 * N, INTER)) / 2
    assert cost.exchanges_per_step == pytest.approx(min(1.0, 0.05 / x))


@pytest.mark.parametrize("algo", ALGOS)
def test_speedup_is_one_at_one_learner_and_at_most_linear(algo):
    c = cluster()
    assert speedup(algo, 1, c) == pytest.approx(1.0)
    for p in (2, 4, 8, 16, 32, 64):
        assert 0 < speedup(algo, p, c) <= p + 1e-9


def test_speedup_definition():
    c = cluster()
    expected = 64 * 0.1 / step_time("ssgd", 64, c).total_s
    assert speedup("ssgd", 64, c) == pytest.approx(expected)
    with pytest.raises(ValueError, match="unknown algorithm"):
        step_time("easgd", 4, c)


# ---------------------------------------------------------------------------- fitting
def _ring_data(link: Link, ranks: list[int]) -> tuple[list, list, list]:
    sizes = [2.0 ** k for k in range(3, 29)]
    rows = [(n, p) for p in ranks for n in sizes]
    lat, byt = ring_coefficients([n for n, _ in rows], [p for _, p in rows])
    times = [link.alpha * a + link.beta * b for a, b in zip(lat, byt, strict=True)]
    return lat, byt, times


def test_fit_recovers_known_link_exactly():
    truth = Link(alpha=15e-6, beta=1 / 1.1e9)
    lat, byt, times = _ring_data(truth, [2, 4])
    fit = fit_alpha_beta(lat, byt, times)
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-6)
    assert fit_error(fit, lat, byt, times) == pytest.approx(0.0, abs=1e-9)


def test_fit_with_noise_is_close():
    truth = Link(alpha=30e-6, beta=1e-10)
    lat, byt, times = _ring_data(truth, [4])
    rng = np.random.default_rng(0)
    noisy = [t * (1 + 0.02 * rng.standard_normal()) for t in times]
    fit = fit_alpha_beta(lat, byt, noisy)
    assert fit.alpha == pytest.approx(truth.alpha, rel=0.1)
    assert fit.beta == pytest.approx(truth.beta, rel=0.1)


def test_fit_pair_exchange_and_nonnegative():
    sizes = [2.0 ** k for k in range(3, 25)]
    fit = fit_alpha_beta([1.0] * len(sizes), sizes, [5e-6 + n * 2e-10 for n in sizes])
    assert (fit.alpha, fit.beta) == (pytest.approx(5e-6), pytest.approx(2e-10))
    # Pure bandwidth data minus a constant would need a negative alpha: pinned at 0.
    fit = fit_alpha_beta([1.0] * len(sizes), sizes, [n * 1e-9 * 1.01 - 1e-9 for n in sizes])
    assert fit.alpha == 0.0 and fit.beta > 0
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0], [8.0], [1e-6])
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0, 1.0], [8.0, 16.0], [1e-6, 0.0])


def _comm_record(intra: Link, inter: Link, hosts: int = 1) -> dict:
    rows = []
    for n in (8, 1024, 2**20, 2**24):
        for name, op, backend, p, link in (("intra/mpi", "intra", "mpi", 2, intra),
                                           ("allreduce/flat", "allreduce", None, 4, inter)):
            t = ring_allreduce(n, p, link)
            rows.append({"name": name, "op": op, "backend": backend, "path": None,
                         "size_bytes": n, "nranks": p, "time_us": t * 1e6})
    return {"benchmark": "comm", "topology": {"hosts": hosts, "intra_backend": "mpi"},
            "rows": rows, "_path": "synthetic.json"}


def test_calibrate_from_comm_record():
    intra, inter = Link(10e-6, 1 / 2e9), Link(40e-6, 1 / 0.5e9)
    cal = calibrate([_comm_record(intra, inter)])
    assert cal.intra.link.alpha == pytest.approx(intra.alpha, rel=1e-6)
    assert cal.intra.link.beta == pytest.approx(intra.beta, rel=1e-6)
    assert cal.inter.link.alpha == pytest.approx(inter.alpha, rel=1e-6)
    assert cal.inter.link.beta == pytest.approx(inter.beta, rel=1e-6)
    assert "intra/mpi" in cal.intra.source and "allreduce/flat" in cal.inter.source
    assert any("one host" in note for note in cal.notes)


def test_calibrate_falls_back_to_one_level():
    record = _comm_record(Link(1e-5, 1e-9), Link(2e-5, 2e-9))
    record["rows"] = [r for r in record["rows"] if r["op"] == "intra"]
    cal = calibrate([record])
    assert cal.inter.link == cal.intra.link
    with pytest.raises(ValueError, match="no usable rows"):
        calibrate([{"benchmark": "comm", "rows": [], "topology": {}}])


# ---------------------------------------------------------------------------- the CLI
def test_paper_constants():
    assert project.SWB_BYTES == 4 * 43_154_944
    assert project.PAPER_COMPUTE_S == pytest.approx(0.1705, abs=1e-3)
    assert project.PAPER_RANKS_PER_NODE == 8


def test_cli_paper_and_local(tmp_path, capsys):
    comm = tmp_path / "comm.json"
    record = _comm_record(Link(10e-6, 1 / 2e9), Link(40e-6, 1 / 0.5e9))
    record.pop("_path")
    comm.write_text(json.dumps(record))
    out = tmp_path / "proj.json"
    code = project.main(["--comm-json", str(comm), "--compute-s", "0.2", "--params", "1000000",
                         "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "cluster paper" in text and "cluster local" in text and "reported" in text
    rec = json.loads(out.read_text())
    assert rec["assumptions"]
    for name in ("paper", "local"):
        rows = rec["clusters"][name]["rows"]
        assert [r["learners"] for r in rows] == [1, 2, 4, 8, 16, 32, 64]
        for algo in ALGOS:
            assert rows[0][algo]["speedup"] == pytest.approx(1.0)
    reported = {r["algo"]: r for r in rec["clusters"]["paper"]["reported"]}
    assert reported["h-adpsgd"]["speedup"] == 40.0
    assert reported["bmuf"]["speedup"] == pytest.approx(54.13)
    assert reported["ssgd"]["speedup"] == pytest.approx(48.71)
    assert all(0 < r["projected"] <= 64 for r in reported.values())
    local = rec["clusters"]["local"]
    assert local["model_bytes"] == 4_000_000 and local["compute_s"] == 0.2


def test_cli_rejects_bad_input(tmp_path, capsys):
    assert project.main(["--cluster", "moon"]) == 2
    assert project.main(["--cluster", "paper", "--learners", "12"]) == 2
    assert project.main(["--cluster", "local", "--comm-json", str(tmp_path / "none.json"),
                         "--compute-s", "1", "--params", "10"]) == 2


def test_overlapped_bmuf_hides_a_block_that_fits_in_tau_steps():
    c = Cluster("t", Link(0.0, 0.0), Link(0.0, 1e-9), 1, 0.1, 10**6)
    # 2 nodes of one learner: a block of 3 MB over a ring of 2 = 3e6 * 1e-9 = 3 ms
    blocking = step_time("bmuf", 2, c, sync_period=8).total_s
    assert blocking == pytest.approx(0.1 + 3e-3 / 8)
    assert step_time("bmuf-ov", 2, c, sync_period=8).total_s == pytest.approx(0.1)
    slow = Cluster("s", Link(0.0, 0.0), Link(0.0, 1e-6), 1, 0.1, 10**6)  # block: 3 s
    assert step_time("bmuf-ov", 2, slow, sync_period=8).total_s == pytest.approx(
        0.1 + (3.0 - 8 * 0.1) / 8)
    # int8: a quarter of the bytes (and a scale per 1024 values) fits inside the 8 steps
    assert step_time("bmuf-ov-int8", 2, slow, sync_period=8).total_s == pytest.approx(0.1)
    slower = Cluster("s", Link(0.0, 0.0), Link(0.0, 2e-6), 1, 0.1, 10**6)  # block: 6 s
    int8 = step_time("bmuf-ov-int8", 2, slower, sync_period=8).total_s
    assert int8 == pytest.approx(0.1 + (6.0 * (1 + 4 / 1024) / 4 - 0.8) / 8)


def test_bmuf_link_fit_predicts_from_the_blocking_row():
    from lab.projection import bmuf_link

    rows = [{"mode": "local", "sec_per_step": 0.1, "inter_bytes_per_step": 0},
            {"mode": "bmuf-tau8", "sec_per_step": 0.15, "inter_bytes_per_step": 1e6},
            {"mode": "bmuf-tau8+overlap", "sec_per_step": 0.11, "inter_bytes_per_step": 1e6},
            {"mode": "bmuf-tau8+int8", "sec_per_step": 0.115,
             "inter_bytes_per_step": 1e6 * (1 + 4 / 1024) / 4}]
    out = bmuf_link.fit({"rows": rows})
    assert out["beta_s_per_byte"] == pytest.approx(0.05 / 1e6)
    got = {r["mode"]: r["predicted_s"] for r in out["rows"]}
    assert got["bmuf-tau8"] == pytest.approx(0.15)
    assert got["bmuf-tau8+overlap"] == pytest.approx(0.1)  # a 0.4 s block inside 0.8 s
    assert got["bmuf-tau8+int8"] == pytest.approx(0.1 + 0.05 * (1 + 4 / 1024) / 4)
