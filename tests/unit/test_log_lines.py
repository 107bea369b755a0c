"""What the training log says where it used to mislead (issue 60, item 4): bytes in a unit
that shows them, a BMUF evaluation before any block sync named as such, one node singular."""

from __future__ import annotations

from pathlib import Path

import pytest

from hadpsgd.train.progress import byte_text
from tests.mpi._resume import run_args
from tests.trainer_threads import train_on_threads


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (812, "812 B"), (4400, "4.4 kB"),
                                         (671_000, "671 kB"), (172 * 2**20, "172.0 MiB"),
                                         (2.31 * 2**30, "2.31 GiB")])
def test_bytes_are_said_in_a_unit_that_shows_them(n: float, text: str) -> None:
    assert byte_text(n) == text


def test_a_bmuf_evaluation_before_any_block_sync_says_so(tiny_data: tuple[Path, Path],
                                                         tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """Blocks of 40 steps, an epoch of fewer: the first epoch's held-out line scores the
    initial model, and says why; after the run's closing sync the last line does not."""
    train_on_threads(run_args(tiny_data, tmp_path, "--algo", "bmuf", "--ranks-per-node", "1",
                              "--sync-period", "40", "--batch-size", "4", "--epochs", "2")[2:],
                     2)
    lines = [x for x in capsys.readouterr().out.splitlines() if "held-out loss" in x]
    note = "before any block sync: the first comes after 40 steps"
    assert note in lines[1] and "epoch 0" in lines[1], lines  # [0]: before training
    assert note not in lines[-1] and note not in lines[0], lines


@pytest.mark.parametrize("algo", ["ssgd", "bmuf", "adpsgd"])
def test_every_algorithm_logs_its_bytes_across_nodes_under_one_name(algo: str) -> None:
    """``wire_bytes`` (the algorithm's own exchanges across nodes) for every algorithm: SSGD's
    gradients too, which a slow-link user compares with BMUF's and ADPSGD's (issue 60)."""
    import torch

    import hadpsgd
    from hadpsgd.comm.threads import ThreadJob, ThreadWorld

    def learner(world: ThreadWorld) -> dict[str, float]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        dist = hadpsgd.Distributed(model, torch.optim.SGD(model.parameters(), lr=0.1), algo,
                                   topology=world, **({"sync_period": 1} if algo == "bmuf"
                                                      else {}))
        for _ in range(3):
            dist.model(torch.randn(3, 4)).pow(2).mean().backward()
            dist.step()
            dist.zero_grad()
        figures = dist.metrics()
        dist.close()
        return figures

    every = ThreadJob(2, 1, timeout=30).run(learner)
    assert all("wire_bytes" in f for f in every), every
    if algo != "adpsgd":  # gossip's rounds are its thread's own pace: maybe none in 3 steps
        assert all(f["wire_bytes"] > 0 and f["internode_bytes"] > 0 for f in every), every
