"""Gradient buckets (``hadpsgd.comm.overlap``): the plan's layout and the reducer's order."""

from __future__ import annotations

import threading

import pytest
import torch

from hadpsgd.comm.overlap import BucketPlan, BucketReducer

F32, F64 = torch.float32, torch.float64


def layout_of(sizes: list[tuple[torch.dtype, int]]) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, offset, numel) of parameters laid out one after another per dtype."""
    offset: dict[torch.dtype, int] = {}
    out = []
    for dtype, n in sizes:
        out.append((dtype, offset.get(dtype, 0), n))
        offset[dtype] = offset.get(dtype, 0) + n
    return out


@pytest.mark.parametrize("bucket_bytes", [1, 40, 100, 10**6])
def test_plan_covers_each_buffer_once_last_parameters_first(bucket_bytes: int) -> None:
    sizes = [(F32, 10), (F32, 3), (F64, 7), (F32, 25), (F64, 1), (F32, 4)]
    layout = layout_of(sizes)
    plan = BucketPlan(layout, bucket_bytes)
    for dtype in (F32, F64):
        mine = [b for b in plan.buckets if b.dtype == dtype]
        # Contiguous, disjoint, together the whole buffer, walking down from its end.
        spans = [(b.lo, b.hi) for b in mine]
        total = sum(n for d, n in sizes if d == dtype)
        assert spans[0][1] == total and spans[-1][0] == 0
        assert all(hi == lo_prev for (_, hi), (lo_prev, _) in zip(spans[1:], spans, strict=False))
        for b in mine:
            assert all(layout[i][0] == dtype for i in b.params)
            assert b.lo == min(layout[i][1] for i in b.params)
            assert b.hi == max(layout[i][1] + layout[i][2] for i in b.params)
            nbytes = (b.hi - b.lo) * torch.empty(0, dtype=dtype).element_size()
            without_last = nbytes - layout[min(b.params)][2] * (4 if dtype == F32 else 8)
            # Filled up to the target and not beyond: without its last parameter it was short.
            assert without_last < bucket_bytes or len(b.params) == 1, b
    assert sorted(i for b in plan.buckets for i in b.params) == list(range(len(sizes)))
    assert max(plan.buckets[0].params) == len(sizes) - 1  # the last parameter comes first
    assert all(plan.of_param[i] == k for k, b in enumerate(plan.buckets) for i in b.params)


def make(plan: BucketPlan, bufs: dict[torch.dtype, torch.Tensor], background: bool,
         scope: str | None = "world", reduce=None) -> tuple[BucketReducer, list[int]]:
    order: list[int] = []
    starts = {(b.dtype, b.lo): k for k, b in enumerate(plan.buckets)}

    def default_reduce(view: torch.Tensor, s: str) -> None:
        base = bufs[view.dtype]
        order.append(starts[(view.dtype, view.storage_offset() - base.storage_offset())])
        view.mul_(10)

    return BucketReducer(plan, bufs, reduce or default_reduce, lambda: scope,
                         lambda v: v.sum(), background, timeout=30.0), order


@pytest.mark.parametrize("background", [False, True])
def test_buckets_reduced_in_index_order_whatever_the_ready_order(background: bool) -> None:
    sizes = [(F32, 4)] * 6
    plan = BucketPlan(layout_of(sizes), 16)  # one parameter per bucket
    bufs = {F32: torch.arange(24, dtype=F32)}
    red, order = make(plan, bufs, background)
    try:
        for _ in range(2):
            before = bufs[F32].clone()
            for i in (0, 3, 5, 1):  # hooks fire in some order; 2 and 4 never do
                red.param_ready(i)
            sums = red.finish()
            assert order == list(range(len(plan)))
            torch.testing.assert_close(bufs[F32], before * 10)
            # Local sums are taken before the reduction, one per bucket in bucket order.
            want = [float(before[b.lo:b.hi].sum()) for b in plan.buckets]
            assert [float(s) for s in sums] == want
            order.clear()
    finally:
        red.close()


def test_background_reduction_starts_before_backward_ends() -> None:
    plan = BucketPlan(layout_of([(F32, 4)] * 3), 16)
    bufs = {F32: torch.ones(12)}
    reduced = threading.Event()

    def reduce(view: torch.Tensor, scope: str) -> None:
        reduced.set()

    red, _ = make(plan, bufs, True, reduce=reduce)
    try:
        red.param_ready(2)  # bucket 0 holds the last parameter
        assert reduced.wait(10.0)  # reduced while "backward" still runs
        red.finish()
        assert red.overlapped >= 1
    finally:
        red.close()


def test_no_scope_reduces_nothing_and_errors_reach_the_caller() -> None:
    plan = BucketPlan(layout_of([(F32, 4)] * 2), 16)
    bufs = {F32: torch.ones(8)}
    red, order = make(plan, bufs, True, scope=None)
    assert red.finish() == [] and order == []
    red.close()

    def boom(view: torch.Tensor, scope: str) -> None:
        raise OSError("link down")

    red, _ = make(plan, bufs, True, reduce=boom)
    with pytest.raises(RuntimeError, match="link down"):
        red.finish()
    red.close()


class TwoLearners:
    """Just what GradSync reads of a Topology."""

    size = local_size = 2
    thread_multiple = True
    timeout = 5.0

    def grad_pipeline(self) -> None:
        """One node: no pipeline."""


@pytest.mark.parametrize(("overlap", "background"), [
    ("auto", False), ("on", True), (True, True), ("off", False), (False, False)])
def test_overlap_setting_on_cpu(overlap: object, background: bool) -> None:
    """auto reduces during backward on CUDA only: on CPU the thread would take backward's
    cores (docs/benchmarks.md)."""
    from hadpsgd.algorithms.gradsync import GradSync

    model = torch.nn.Linear(3, 2)
    sync = GradSync(list(model.parameters()), TwoLearners(), lambda: None,  # type: ignore[arg-type]
                    overlap=overlap)  # type: ignore[arg-type]
    try:
        assert sync.overlapped is background
    finally:
        sync.close()
    with pytest.raises(ValueError, match="overlap"):
        GradSync(list(model.parameters()), TwoLearners(), lambda: None,  # type: ignore[arg-type]
                 overlap="sometimes")  # type: ignore[arg-type]


def test_the_pipelined_world_route_is_built_only_where_a_mean_can_be_world_wide() -> None:
    """GradSync asks the topology for the pipeline (a duplicated inter-node communicator)
    only for algorithms whose gradient scope can be ``world``: SSGD, BMUF in its warm-up."""
    from types import SimpleNamespace

    from hadpsgd.algorithms import ADPSGD, BMUF, SSGD, BMUFOptions
    from hadpsgd.algorithms.gradsync import GradSync

    class Counting(TwoLearners):
        asked = 0

        def grad_pipeline(self) -> None:
            Counting.asked += 1

    model = torch.nn.Linear(3, 2)
    for world, asked in ((False, 0), (True, 1)):
        Counting.asked = 0
        sync = GradSync(list(model.parameters()), Counting(), lambda: None,  # type: ignore[arg-type]
                        world=world)
        sync.close()
        assert Counting.asked == asked
    assert SSGD.reduces_world(SimpleNamespace()) is True  # type: ignore[arg-type]
    assert ADPSGD.reduces_world(SimpleNamespace()) is False  # type: ignore[arg-type]
    for warmup, world in ((0, False), (25, True)):
        algo = SimpleNamespace(options=BMUFOptions(warmup_steps=warmup))
        assert BMUF.reduces_world(algo) is world  # type: ignore[arg-type]
