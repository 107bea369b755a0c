"""The start's broadcast of rank 0's model across nodes, counted apart (issue 57, item 3).

Every replica starts from rank 0's parameters and buffers: each other node receives the
model at least once, a fixed cost beside the per-step bytes that the run's last line and its
``bytes`` record now say apart. Checked on learners as threads against the model's size
written out by hand.
"""

from __future__ import annotations

import torch

from hadpsgd.algorithms import build
from hadpsgd.comm import World
from hadpsgd.comm.threads import ThreadJob
from hadpsgd.train.progress import internode_line

# Linear(6, 3): 18 weights + 3 biases; BatchNorm1d(3): weight, bias, running mean and
# variance (3 floats each) and one int64 count: 33 float32 values and 8 bytes.
MODEL_BYTES = 33 * 4 + 8


def _learner(algo_name: str) -> object:
    def learner(w: World) -> tuple[int, str]:
        torch.manual_seed(w.rank)
        model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.BatchNorm1d(3))
        algo = build(algo_name, model, torch.optim.SGD(model.parameters(), lr=0.1), w)
        try:
            return algo.startup_bytes, internode_line(algo, 1, 10)
        finally:
            algo.close()
    return learner


def test_each_other_node_receives_the_model_once() -> None:
    for algo_name in ("ssgd", "bmuf", "adpsgd"):
        for startup, line in ThreadJob(6, 2, timeout=60).run(_learner(algo_name)):
            assert startup == 2 * MODEL_BYTES, algo_name  # 3 nodes: two receive it
            assert f"at start rank 0's model to the other nodes: {2 * MODEL_BYTES} B" in line


def test_one_node_sends_nothing_across() -> None:
    for startup, line in ThreadJob(2, 2, timeout=60).run(_learner("ssgd")):
        assert startup == 0
        assert "at start" not in line
