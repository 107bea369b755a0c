"""``Distributed(run_dir=...)``: an API run leaves the CLI's run directory behind (issue 60)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hadpsgd
from hadpsgd.plot import read_run, title_of
from hadpsgd.train.metrics import read_metrics
from tests.fakes import OneLearner


def _train(run_dir, algo: str, steps: int, state=None, **kw) -> hadpsgd.Distributed:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    kw.setdefault("log_every", 5)
    dist = hadpsgd.Distributed(net, opt, algo, topology=OneLearner(), run_dir=run_dir, **kw)
    if state is not None:
        dist.load_state_dict(state)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    for _ in range(steps):
        loss = nn.functional.cross_entropy(dist.model(x), y)
        loss.backward()
        dist.step(loss)
        dist.zero_grad()
    return dist


@pytest.mark.parametrize("algo", ["ssgd", "bmuf"])
def test_an_api_run_leaves_config_and_metrics_that_plot_reads(tmp_path, algo):
    out = tmp_path / "run"
    dist = _train(out, algo, 12)
    dist.record_eval(0.7, accuracy=0.5, wer=12.5)
    dist.close()
    config = json.loads((out / "config.json").read_text())
    assert config["api"] and config["train"]["algo"] == algo and config["world"]["size"] == 1
    assert config["optimizer"]["kind"] == "sgd" and config["optimizer"]["lr"] == 0.05
    assert config["shared"]["precision"] == "fp32" and "params" not in config["optimizer"]
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [5, 10]  # every log_every steps
    for r in train:
        assert r["loss"] > 0 and r["lr"] == 0.05 and r["loss_of"] == "rank 0"
        # the same names under every algorithm (wire_bytes was missing under SSGD)
        assert {"wire_bytes", "internode_bytes", "grad_wire_bytes"} <= set(r)
    (ev,) = [r for r in records if r["kind"] == "eval"]
    assert (ev["step"], ev["heldout_loss"], ev["heldout_acc"], ev["wer"]) == (12, 0.7, 0.5, 12.5)
    curves = read_run(out)
    assert curves.train_loss[0] == [5, 10] and curves.heldout_loss == ([12], [0.7])
    assert title_of(out).endswith(f"({algo} on 1 learners)")


def test_a_resume_in_the_run_directory_keeps_the_second_telling(tmp_path):
    out = tmp_path / "run"
    first = _train(out, "ssgd", 12)
    state = first.state_dict()
    first.close()
    # trained on to step 12, then resumed from that state: the records go on from 12
    _train(out, "ssgd", 8, state=state).close()
    records = read_metrics(out / "metrics.jsonl")
    resumes = [r for r in records if r["kind"] == "resume"]
    assert [r["step"] for r in resumes] == [0, 12]  # the new start, then the loaded state
    assert read_run(out).train_loss[0] == [15, 20]  # steps after 12 of the second telling
    # a script started afresh in a used directory: the earlier run's records are voided
    _train(out, "ssgd", 6).close()
    assert read_run(out).train_loss[0] == [5]


def test_bad_run_directory_options_are_refused_by_keyword(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(hadpsgd.OptionError, match="run_dir .* is a file"):
        _train(afile, "ssgd", 0)
    with pytest.raises(hadpsgd.OptionError, match="log_every must be a positive integer"):
        _train(tmp_path / "r", "ssgd", 0, log_every=0)


def test_without_run_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _train(None, "ssgd", 6).close()
    assert list(tmp_path.iterdir()) == []


def test_a_record_torn_by_a_killed_script_is_cut_before_the_next_start_appends(tmp_path):
    # As the CLI's writer does: appending after a half-written line would glue the next
    # record onto it, and the file would read as damaged.
    out = tmp_path / "run"
    _train(out, "ssgd", 6).close()
    with (out / "metrics.jsonl").open("a") as fh:
        fh.write('{"kind": "train", "step": 7, "lo')  # killed mid-write
    _train(out, "ssgd", 6).close()
    assert read_run(out).train_loss[0] == [5]  # read back whole: the new start's records
    assert all(r["kind"] != "train" or r["step"] != 7
               for r in read_metrics(out / "metrics.jsonl"))
