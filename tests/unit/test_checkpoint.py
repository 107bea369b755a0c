import os

import pytest
import torch

from hadpsgd.train.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((3,), v)}, "progress": {"global_step": int(v)}}


def test_save_load_latest(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 10):
        save_checkpoint(_state(step), checkpoint_path(tmp_path, step))
    latest = latest_checkpoint(tmp_path)
    assert latest == checkpoint_path(tmp_path, 10)
    assert torch.equal(load_checkpoint(latest)["model"]["w"], torch.full((3,), 10.0))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_failed_write_keeps_previous_file(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint(_state(1), path)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_checkpoint(_state(2), path)
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((3,), 1.0))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_latest_without_pointer_uses_highest_step(tmp_path):
    for step in (3, 20, 7):
        save_checkpoint(_state(step), checkpoint_path(tmp_path, step))
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 20)


def test_bad_checkpoint_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="--resume"):
        load_checkpoint(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        load_checkpoint(bad)
    other = tmp_path / "other.pt"
    torch.save({"x": 1}, other)
    with pytest.raises(ValueError, match="not a hadpsgd checkpoint"):
        load_checkpoint(other)
