"""ADPSGD's evaluation of the replicas as they are (``eval_model replicas``, issue 57).

On a slow link an epoch's average of the replicas weighed as much as the gossip (two
emulated hosts, FSDD: ~34 of 69 kB a step). With ``eval_model replicas`` (the default on
``--wire topk`` and ``sign``) an epoch's evaluation scores each learner's own replica and no
model crosses the nodes; the run's end (:meth:`finish`) still averages the replicas, in fp32,
into the deployed model. Checked on the in-process world against the replicas' exact mean
computed here.
"""

from __future__ import annotations

import pytest
import torch

from hadpsgd.algorithms import ADPSGD
from hadpsgd.algorithms.adpsgd import ADPSGDOptions
from hadpsgd.cli import ConfigError
from hadpsgd.comm import World
from hadpsgd.comm.threads import ThreadJob


@pytest.mark.parametrize(("wire", "eval_model", "average"), [
    ("topk", None, False), ("sign", None, False), ("fp32", None, True), ("int8", None, True),
    ("topk", "average", True), ("fp32", "replicas", False)])
def test_the_default_is_the_replicas_on_a_compressed_gossip_wire(
        wire: str, eval_model: str | None, average: bool) -> None:
    assert ADPSGDOptions(wire=wire, eval_model=eval_model).evaluates_average() is average


def test_an_unknown_choice_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="average.*replicas"):
        ADPSGDOptions(eval_model="mean")


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _learner(eval_model: str | None) -> object:
    def learner(w: World) -> dict[str, object]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
        algo = ADPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), w, wire="topk",
                      eval_model=eval_model)
        gen = torch.Generator().manual_seed(w.rank)
        out: dict[str, object] = {}
        try:
            for _ in range(3):
                algo.grads.buffers[torch.float32].copy_(
                    torch.randn(algo.flat.numel(), generator=gen))
                algo.step()
                algo.grads.zero_()
            algo.sync()  # an epoch's end
            with algo.evaluation_parameters() as m:
                out["evaluated_is_own"] = torch.equal(_flat(m), algo.flat)
            out["epoch_bytes"] = algo.sync_bytes
            out["note"] = algo.evaluation_note()
            algo.finish()  # the run's end
            exact = w.allreduce_(algo.flat.clone(), op="avg")  # fp32, written here
            with algo.evaluation_parameters() as m:
                out["final_error"] = float((_flat(m) - exact).abs().max())
            out["final_bytes"] = algo.sync_bytes - int(out["epoch_bytes"])
            out["final_note"] = algo.evaluation_note()
            out["one_model"] = algo.flat.numel() * 4
        finally:
            algo.close()
        return out
    return learner


def test_replicas_cross_nothing_until_the_run_ends_then_the_exact_average() -> None:
    for r in ThreadJob(4, 2, timeout=60).run(_learner(None)):
        assert r["evaluated_is_own"], "an epoch's evaluation must score the replica itself"
        assert r["epoch_bytes"] == 0, "no model may cross the nodes before the run's end"
        assert "own replica" in str(r["note"])
        # The deployed model: the replicas' mean, sent whole in fp32 (nothing to send it
        # against), to float rounding.
        assert r["final_error"] < 1e-6
        assert 0 < int(r["final_bytes"]) <= int(r["one_model"])
        assert r["final_note"] == ""


def test_average_on_a_compressed_wire_still_averages_every_epoch() -> None:
    for r in ThreadJob(4, 2, timeout=60).run(_learner("average")):
        assert not r["evaluated_is_own"]
        assert int(r["epoch_bytes"]) > 0
        assert r["note"] == ""
