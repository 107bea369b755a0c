"""BMUF's closing flush (``--bmuf-flush``): what the roundings hold back, sent once at the end.

Two or three learners as threads, each its own node (:class:`hadpsgd.comm.threads.ThreadJob`,
the side channel's own compressed mean), SGD at block momentum 0 and block rate 1, so a block
sync adds the mean of the deltas to the start point. What is held, from the definitions and
not from the code:

- After a flush in fp32 the global model is the workers' mean plus every rounding that was
  waiting: ``start + mean_i(local_i - start + worker_i) + servers`` (the workers' unsent
  progress in their models or their residuals, each server's shard of the mean's rounding),
  bit-identical on every worker; nothing is held back after it, and every worker starts at
  the global model.
- In int4 it lands within int4's rounding of that; the bytes it sends are counted and are
  what the flush's wire costs.
- ``auto`` flushes in int4 on a sparse wire only where that costs at most 1/16 of what the
  block syncs sent, so a short run (FSDD's 160 steps) has none and its bytes are untouched.
"""

from __future__ import annotations

import pytest
import torch

from hadpsgd.algorithms import BMUF
from hadpsgd.algorithms.bmuf.exchange import part_key
from hadpsgd.algorithms.bmuf.options import FLUSH_SHARE, BMUFOptions
from hadpsgd.cli import ConfigError
from hadpsgd.comm import World
from hadpsgd.comm.threads import ThreadJob

TAU, BLOCKS = 2, 3
KEY = part_key(0, torch.float32, 0)  # the model's part of the one fragment
F32 = torch.float32


def _held(algo: BMUF) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's residual of the model's part and its node's server shard."""
    saved = algo.exchange.state_dict()[KEY]
    return saved["worker"].clone(), saved["server"].clone()


def _learner(world: World, residual: str, flush: str, wire: str = "signtopk") -> dict:
    torch.manual_seed(0)  # the same initial model on every learner
    model = torch.nn.Linear(100, 50)
    algo = BMUF(model, torch.optim.SGD(model.parameters(), lr=0.1), world, sync_period=TAU,
                block_momentum=0.0, wire=wire, residual=residual, worker_lr="global",
                flush=flush)
    gen = torch.Generator().manual_seed(1 + world.rank)  # each learner its own data
    for _ in range(TAU * BLOCKS):
        x, y = torch.randn(16, 100, generator=gen), torch.randn(16, 50, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        algo.step()
        algo.zero_grad()
    worker, server = _held(algo)
    out = {"local": algo.params.buffers[F32].clone(), "worker": worker, "server": server,
           "start": algo.filter.start_point[F32].clone(), "bytes": algo.exchange.bytes_sent,
           "due": algo.finish_changes_state(), "wire": algo.flush_wire(),
           "cost": algo.exchange.flush_bytes(0, F32, algo.params.buffers[F32], "int4")}
    algo.finish()
    worker, server = _held(algo)
    out.update(after=algo.params.buffers[F32].clone(), worker_after=worker,
               server_after=server, start_after=algo.filter.start_point[F32].clone(),
               glob=algo.filter.global_model[F32].clone(), bytes_after=algo.exchange.bytes_sent)
    algo.close()
    return out


def _run(residual: str, flush: str, workers: int = 2, wire: str = "signtopk") -> list[dict]:
    return ThreadJob(workers, timeout=60).run(lambda w: _learner(w, residual, flush, wire))


def _mean_with_everything_held(runs: list[dict]) -> torch.Tensor:
    n, k = runs[0]["local"].numel(), len(runs)
    start = runs[0]["start"]
    workers = sum(r["local"] - start + r["worker"] for r in runs) / k
    servers = torch.cat([r["server"] for r in runs])[:n]  # node j serves shard j (one bucket)
    return start + workers + servers


@pytest.mark.parametrize("residual", ["model", "delta"])
def test_an_fp32_flush_deploys_the_workers_mean_with_every_rounding_held(residual):
    runs = _run(residual, "fp32", workers=3)
    expected = _mean_with_everything_held(runs)
    assert (expected - runs[0]["start"]).norm() > 1e-3, "something was held back"
    for r in runs:
        torch.testing.assert_close(r["glob"], expected, rtol=0, atol=1e-6)
        assert torch.equal(r["glob"], runs[0]["glob"]), "the same bits on every worker"
        assert not r["worker_after"].any() and not r["server_after"].any(), "nothing held"
        assert torch.equal(r["after"], r["glob"]) and torch.equal(r["start_after"], r["glob"])
        assert r["due"] and r["wire"] == "fp32"


def test_an_int4_flush_lands_within_its_rounding_and_its_bytes_are_counted():
    runs = _run("model", "int4")
    expected = _mean_with_everything_held(runs)
    sent = expected - runs[0]["start"]
    error = (runs[0]["glob"] - expected).norm() / sent.norm()
    assert error < 0.2, f"int4's rounding of the flushed progress: {error:.3f}"
    for r in runs:
        assert r["bytes_after"] - r["bytes"] == r["cost"] > 0
        assert torch.equal(r["glob"], runs[0]["glob"])


def test_none_and_a_short_runs_auto_leave_the_run_as_it_was():
    for flush in ("none", "auto"):
        for r in _run("model", flush):
            assert r["wire"] is None and not r["due"]
            # Nothing sent, nothing moved: the workers keep their roundings in their models.
            assert r["bytes_after"] == r["bytes"]
            assert torch.equal(r["after"], r["local"]) and torch.equal(r["glob"], r["start"])
            # Auto's rule: an int4 flush here costs more than 1/16 of the syncs' bytes.
            assert r["cost"] * FLUSH_SHARE > r["bytes"]


def _auto_at(world: World, wire: str, sent: int) -> tuple[str | None, int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 50)
    algo = BMUF(model, torch.optim.SGD(model.parameters(), lr=0.1), world, sync_period=TAU,
                wire=wire, worker_lr="global")
    cost = algo.exchange.flush_bytes(0, F32, algo.params.buffers[F32], "int4")
    algo.exchange.bytes_sent = cost * FLUSH_SHARE + sent  # as if that many syncs were sent
    wire_then = algo.flush_wire()
    algo.close()
    return wire_then, cost


@pytest.mark.parametrize("wire,flushes", [("signtopk", True), ("topk", True),
                                          ("sign", False), ("int8", False)])
def test_auto_flushes_a_sparse_wire_once_its_syncs_sent_sixteen_flushes(wire, flushes):
    for sent, due in ((0, flushes), (-1, False)):
        for got, cost in ThreadJob(2, timeout=60).run(
                lambda w, sent=sent: _auto_at(w, wire, sent)):
            assert cost > 0 and got == ("int4" if due else None), (wire, sent)


def test_flush_is_a_compressed_wires_option():
    with pytest.raises(ConfigError, match="--bmuf-flush"):
        BMUFOptions(flush="fp16")
    with pytest.raises(ConfigError, match="--bmuf-flush is read by --wire bf16"):
        BMUFOptions(wire="fp32", flush="int4").check_read(["flush"])
    BMUFOptions(wire="signtopk", flush="none").check_read(["flush"])
