"""``--cuda-graph`` captures in CUDA's thread-local mode (issue 59 item 2), checked without a
GPU: the capture context torch opens inside ``make_graphed_callables`` is given that default
while the capture runs, and only then. (tests/gpu pins from a thread during a real capture.)
"""

from __future__ import annotations

import inspect

import torch

from hadpsgd.train.graphs import CAPTURE_MODE, thread_local_capture


class _Recorder:
    """Stands in for ``torch.cuda.graph`` (which needs CUDA to construct): keeps its kwargs."""

    made: list[dict] = []

    def __init__(self, cuda_graph: object, pool: object = None, stream: object = None,
                 capture_error_mode: str = "global") -> None:
        _Recorder.made.append({"pool": pool, "mode": capture_error_mode})


def test_the_capture_context_defaults_to_thread_local_meanwhile(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph", _Recorder)
    _Recorder.made.clear()
    with thread_local_capture():
        torch.cuda.graph(object(), pool="p")  # as make_graphed_callables calls it
        torch.cuda.graph(object(), capture_error_mode="relaxed")  # said explicitly: kept
    torch.cuda.graph(object())  # after: torch's own default again
    assert CAPTURE_MODE == "thread_local"
    assert _Recorder.made == [{"pool": "p", "mode": "thread_local"},
                              {"pool": None, "mode": "relaxed"},
                              {"pool": None, "mode": "global"}]
    assert torch.cuda.graph is _Recorder


def test_the_original_comes_back_after_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph", _Recorder)
    try:
        with thread_local_capture():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert torch.cuda.graph is _Recorder


def test_torch_opens_the_capture_through_the_name_it_is_given():
    # make_graphed_callables looks torch.cuda.graph up at the call; if a torch release
    # stops doing so, the thread-local default silently stops applying: this says so.
    source = inspect.getsource(torch.cuda.make_graphed_callables)
    assert "torch.cuda.graph(" in source
