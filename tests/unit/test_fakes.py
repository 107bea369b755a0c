"""The unit tests' fake topology has the real Topology's interface, name for name."""

from __future__ import annotations

import dataclasses
import inspect

from hadpsgd.comm import Topology
from tests.fakes import OneLearner


def _public(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_every_name_of_the_fake_is_a_name_of_topology():
    fields = {f.name for f in dataclasses.fields(Topology)}
    missing = sorted(_public(OneLearner) - fields - set(dir(Topology)))
    assert not missing, f"OneLearner has names Topology lacks: {missing}"


def test_the_fakes_methods_take_topologys_parameters():
    for name, fake in vars(OneLearner).items():
        if name.startswith("_") or not callable(fake):
            continue
        real = inspect.signature(getattr(Topology, name))
        mine = inspect.signature(fake)
        # The fake may leave out trailing optional parameters it does not need, never rename
        # or reorder the ones it has.
        got = list(mine.parameters)
        assert got == list(real.parameters)[:len(got)], (name, mine, real)


def test_the_fake_is_a_world_of_one():
    import torch

    topo = OneLearner()
    t = torch.arange(3.0)
    assert topo.allreduce_(t) is t and topo.broadcast_(t) is t
    assert (topo.rank, topo.size, topo.num_nodes) == (0, 1, 1)
