"""config.json's provenance: one entry per start of a run directory, earlier ones kept."""

from __future__ import annotations

import json

from hadpsgd.assembly import provenance


class TwoHosts:
    """A stand-in topology of 3 ranks on two hosts, seen from rank 0."""

    rank, size = 0, 3
    hosts = ["a", "b", "b"]


def test_entry_and_append(tmp_path):
    start = provenance.entry(TwoHosts(), resume=None)
    assert start["hosts"] == {"a": 1, "b": 2} and start["world_size"] == 3
    assert start["versions"]["torch"] and start["argv"]
    path = tmp_path / "config.json"
    provenance.write_config(path, {"train": {"epochs": 1}}, start)
    again = {**start, "resume": "auto"}
    provenance.write_config(path, {"train": {"epochs": 2}}, again)
    data = json.loads(path.read_text())
    assert data["train"] == {"epochs": 2}  # the latest start's configuration
    assert [e["resume"] for e in data["provenance"]] == [None, "auto"]  # appended


def test_unreadable_old_file_is_replaced(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{broken")
    provenance.write_config(path, {"x": 1}, {"time": "t"})
    assert json.loads(path.read_text())["provenance"] == [{"time": "t"}]


def test_a_resume_under_other_software_is_said(tmp_path):
    start = provenance.entry(TwoHosts(), resume=None)
    path = tmp_path / "config.json"
    assert provenance.write_config(path, {"x": 1}, start) == []  # a fresh start
    assert provenance.write_config(path, {"x": 1}, {**start, "resume": "auto"}) == []
    newer = {**start, "versions": {**start["versions"], "torch": "9.9.9"},
             "git_commit": "abc123"}
    said = provenance.write_config(path, {"x": 1}, newer)
    assert f"torch {start['versions']['torch']} -> 9.9.9" in said
    assert any(s.startswith("git commit ") and s.endswith("-> abc123") for s in said) \
        or start["git_commit"] is None
