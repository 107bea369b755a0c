"""Crash-safe checkpoints: manifests, checksums, keep-last-K, crashes at every write phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hadpsgd.train.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "progress": {"global_step": step}}


def _save(root: Path, step: int, keep: int = 0) -> Path:
    return save_checkpoint(_state(step), checkpoint_path(root, step), keep=keep,
                           meta={"step": step, "world_size": 2, "algo": "ssgd"})


def test_save_load_latest_and_manifest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (10, 20):
        _save(tmp_path, step)
    latest = latest_checkpoint(tmp_path)
    assert latest == checkpoint_path(tmp_path, 20)
    assert (tmp_path / "latest").read_text().strip() == latest.name
    assert torch.equal(load_checkpoint(latest)["model"]["w"], torch.full((3,), 20.0))
    manifest = json.loads((latest / MANIFEST_FILE).read_text())
    assert manifest["step"] == 20 and manifest["world_size"] == 2 and manifest["algo"] == "ssgd"
    entry = manifest["files"][STATE_FILE]
    assert entry["bytes"] == (latest / STATE_FILE).stat().st_size
    import hashlib
    assert entry["sha256"] == hashlib.sha256((latest / STATE_FILE).read_bytes()).hexdigest()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries


def test_keep_last_k(tmp_path: Path) -> None:
    for step in range(1, 7):
        _save(tmp_path, step * 10, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000040", "step-00000050", "step-00000060"]


def test_same_step_rewritten_in_place(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    save_checkpoint({"model": {"w": torch.zeros(1)}, "progress": {}},
                    checkpoint_path(tmp_path, 10))
    assert torch.equal(load_checkpoint(checkpoint_path(tmp_path, 10))["model"]["w"],
                       torch.zeros(1))


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "no-manifest", "bad-manifest",
                                    "no-state", "list-manifest", "no-files", "empty-files",
                                    "bad-entry", "path-entry"])
def test_corrupt_newest_is_named_and_skipped(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    state = newest / STATE_FILE
    if damage == "truncate":
        data = state.read_bytes()
        state.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0x10
        state.write_bytes(bytes(data))
    elif damage == "no-manifest":
        (newest / MANIFEST_FILE).unlink()
    elif damage == "bad-manifest":
        (newest / MANIFEST_FILE).write_text("{not json")
    elif damage == "list-manifest":
        (newest / MANIFEST_FILE).write_text("[1, 2]")
    elif damage in ("no-files", "empty-files", "bad-entry", "path-entry"):
        manifest = json.loads((newest / MANIFEST_FILE).read_text())
        if damage == "no-files":
            del manifest["files"]
        elif damage == "empty-files":
            manifest["files"] = {}
        elif damage == "bad-entry":
            manifest["files"][STATE_FILE]["bytes"] = "12"
        else:
            manifest["files"]["../elsewhere"] = dict(manifest["files"][STATE_FILE])
        (newest / MANIFEST_FILE).write_text(json.dumps(manifest))
    else:
        state.unlink()
    reports: list[str] = []
    assert latest_checkpoint(tmp_path, report=reports.append) == checkpoint_path(tmp_path, 10)
    assert len(reports) == 1 and "step-00000020" in reports[0]
    reason = {"truncate": "truncated", "bitflip": "checksum", "no-manifest": "no MANIFEST",
              "bad-manifest": "unreadable", "no-state": "missing",
              "list-manifest": "not a JSON object", "no-files": "does not list",
              "empty-files": "does not list", "bad-entry": "no valid size",
              "path-entry": "no valid size"}[damage]
    assert reason in reports[0]
    with pytest.raises(CheckpointError, match="step-00000020"):
        load_checkpoint(newest)


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "file.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "file.pt")
    other = _save(tmp_path, 5)
    torch.save({"something": 1}, other / STATE_FILE)  # valid pickle, wrong content
    with pytest.raises(CheckpointError, match=r"step-00000005.*(bytes|SHA-256)"):
        verify_checkpoint(other)


# A crash (SIGKILL) right after each write phase, in a real separate process.
CRASH = textwrap.dedent("""
    import os, signal, sys, torch
    from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint
    root, phase = sys.argv[1], sys.argv[2]
    def hook(p):
        if p == phase:
            os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint({"model": {"w": torch.ones(4)}, "progress": {}},
                    checkpoint_path(root, 20), on_phase=hook)
""")


@pytest.mark.parametrize("phase", ["ckpt-data", "ckpt-manifest", "ckpt-rename"])
def test_crash_at_each_phase_leaves_a_valid_checkpoint(tmp_path: Path, phase: str) -> None:
    _save(tmp_path, 10)
    proc = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), phase],
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    found = latest_checkpoint(tmp_path)
    # Before the rename the new checkpoint does not exist under its name; after it, it is
    # complete (the `latest` pointer may still name the old one: readers do not trust it).
    expected = 20 if phase == "ckpt-rename" else 10
    assert found == checkpoint_path(tmp_path, expected)
    load_checkpoint(found)
    # The next writer cleans up what the crashed one left behind.
    _save(tmp_path, 30, keep=5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step")]
    assert os.listdir(checkpoint_path(tmp_path, 30))


class _Trap:
    """Unpickling this would call ``open(marker, "w")``: code run by merely loading a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _replace_state(ckpt, obj) -> None:
    """Put ``obj`` as the checkpoint's state with a matching manifest (checksums pass)."""
    import hashlib
    import json

    torch.save(obj, ckpt / "state.pt")
    data = (ckpt / "state.pt").read_bytes()
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    from hadpsgd.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    ckpt = save_checkpoint({"model": {"w": torch.ones(2)}, "progress": {"global_step": 1}},
                           tmp_path / "checkpoints" / "step-00000001")
    marker = tmp_path / "pwned"
    _replace_state(ckpt, {"model": {"w": torch.ones(2)}, "progress": {},
                          "extra": _Trap(str(marker))})
    with pytest.raises(CheckpointError, match="could run code") as err:
        load_checkpoint(ckpt)
    assert str(ckpt) in str(err.value) and "weights_only=False" in str(err.value)
    assert not marker.exists()  # refused before anything it names was called


def test_only_plain_data_is_saved(tmp_path):
    from dataclasses import dataclass

    from hadpsgd.train.checkpoint import load_checkpoint, plain_data_problem, save_checkpoint

    @dataclass
    class Pos:
        step: int

    assert plain_data_problem({"a": [torch.ones(1), (1, 2.0, "x", None)], 3: torch.float32}) \
        is None
    assert "state['pos']" in plain_data_problem({"pos": Pos(1)})
    with pytest.raises(TypeError, match="plain data"):
        save_checkpoint({"model": {}, "progress": {}, "pos": Pos(1)}, tmp_path / "step-00000001")
    assert not (tmp_path / "step-00000001").exists()
    # What the trainer writes (tensors, numbers, strings, containers) loads back as it was.
    state = {"model": {"w": torch.arange(3.0)}, "progress": {"global_step": 7},
             "rng": torch.get_rng_state(), "history": [{"loss": 1.5}]}
    loaded = load_checkpoint(save_checkpoint(state, tmp_path / "c" / "step-00000007"))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["progress"] == {"global_step": 7} and torch.equal(loaded["rng"], state["rng"])


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_space(tmp_path, monkeypatch,
                                                                       wrapped):
    import errno

    from hadpsgd.train import checkpoint as ck

    ckpt_dir = tmp_path / "checkpoints"
    first = ck.save_checkpoint({"model": {"w": torch.ones(4)}, "progress": {"global_step": 1}},
                               ckpt_dir / "step-00000001")

    def full(*args, **kw):
        if not wrapped:
            raise OSError(errno.ENOSPC, "No space left on device")
        try:  # what torch.save does: the zip writer's RuntimeError, raised while handling
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None

    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(ck.CheckpointWriteError) as err:
        ck.save_checkpoint({"model": {"w": torch.ones(2**18)}, "progress": {"global_step": 2}},
                           ckpt_dir / "step-00000002")
    msg = str(err.value)
    assert str(ckpt_dir) in msg and "step-00000002" in msg and "1.0 MiB" in msg
    assert "--resume auto" in msg and "free" in msg
    # Nothing partial is left, the pointer did not move, the previous checkpoint is valid.
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-00000001"]
    assert (ckpt_dir / "latest").read_text().strip() == "step-00000001"
    assert ck.latest_checkpoint(ckpt_dir) == first


def test_a_full_disk_at_a_resumes_checkpoint_of_the_same_step_keeps_the_older_one(
        tmp_path, monkeypatch):
    """Issue 55 item 8e: a resume writes the checkpoint of a step it has again; the older one
    was moved aside for it, and where the new one never took its place (ENOSPC) it stayed
    hidden, lost to --resume auto and to pruning. And a checkpoint folder that could not be
    made on a full disk was an OSError's traceback."""
    import errno

    from hadpsgd.train import checkpoint as ck

    ckpt_dir = tmp_path / "checkpoints"
    path = ck.save_checkpoint(_state(2), ckpt_dir / "step-00000002")
    real_replace = ck.os.replace

    def full(src, dst):
        if Path(src).name.startswith(".step-00000002.tmp-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", full)
    with pytest.raises(ck.CheckpointWriteError) as err:
        ck.save_checkpoint({"model": {"w": torch.zeros(3)}, "progress": {"global_step": 2}},
                           path)
    msg = str(err.value)
    assert "\n" not in msg and f"no space left in {ckpt_dir}" in msg and "--resume auto" in msg
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-00000002"]
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((3,), 2.0))
    # The folder of the checkpoints cannot be made: the same one line, no OSError.
    monkeypatch.setattr(ck.Path, "mkdir", lambda *a, **kw: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(ck.CheckpointWriteError, match="no space left in .*new for checkpoint"):
        ck.save_checkpoint(_state(3), tmp_path / "new" / "step-00000003")


# --------------------------------------------------------------- --keep-best (best.json)
def _scored(root: Path, step: int, loss: float | None, keep: int, keep_best: int) -> Path:
    meta: dict = {"step": step, "epoch": step // 10, "world_size": 1, "algo": "ssgd"}
    if loss is not None:  # written right after an evaluation of its step
        meta["heldout"] = {"loss": loss, "accuracy": 1.0 - loss / 10, "frames": 100}
    return save_checkpoint(_state(step), checkpoint_path(root, step), keep=keep, meta=meta,
                           keep_best=keep_best)


def test_pruning_spares_the_best_by_heldout_loss_and_best_json_lists_them(tmp_path):
    from hadpsgd.train.best import read_best

    # losses by step; step 35 is a --checkpoint-every checkpoint without a score
    for step, loss in [(10, 3.0), (20, 1.0), (30, 2.0), (35, None), (40, 0.5), (50, 4.0),
                       (60, 5.0)]:
        _scored(tmp_path, step, loss, keep=2, keep_best=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    # the newest 2 (50, 60) and the best 2 (40: 0.5, 20: 1.0); 35 (no score) pruned as usual
    assert names == ["step-00000020", "step-00000040", "step-00000050", "step-00000060"]
    best = read_best(tmp_path)
    assert [(b["name"], b["heldout_loss"], b["best"]) for b in best] == [
        ("step-00000040", 0.5, True), ("step-00000020", 1.0, True),
        ("step-00000050", 4.0, False), ("step-00000060", 5.0, False)]
    assert best[0]["step"] == 40 and best[0]["heldout_acc"] == pytest.approx(0.95)
    doc = json.loads((tmp_path / "best.json").read_text())
    assert doc["keep_best"] == 2 and doc["metric"] == "heldout_loss"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries
    # the score is in the checkpoint's own (checksummed) manifest too
    assert verify_checkpoint(checkpoint_path(tmp_path, 40))["heldout"]["loss"] == 0.5


def test_keep_best_zero_prunes_as_before_and_ties_pick_the_newer(tmp_path):
    from hadpsgd.train.best import read_best
    from hadpsgd.train.checkpoint import scored_checkpoints

    for step, loss in [(10, 0.1), (20, 2.0), (30, 3.0)]:
        _scored(tmp_path / "a", step, loss, keep=1, keep_best=0)
    assert [p.name for p in list_checkpoints(tmp_path / "a")] == ["step-00000030"]
    assert [b["best"] for b in read_best(tmp_path / "a")] == [False]
    for step in (10, 20, 30):  # keep all: nothing pruned, the index still written
        _scored(tmp_path / "b", step, 1.0, keep=0, keep_best=1)
    ranked = scored_checkpoints(tmp_path / "b")
    assert [p.name for p, _ in ranked] == ["step-00000030", "step-00000020", "step-00000010"]
    assert [b["best"] for b in read_best(tmp_path / "b")] == [True, False, False]
    # no score anywhere (e.g. only --checkpoint-every so far): no best.json
    _scored(tmp_path / "c", 5, None, keep=3, keep_best=1)
    assert not (tmp_path / "c" / "best.json").exists() and read_best(tmp_path / "c") == []


def test_keep_best_may_change_on_a_resume_and_must_not_be_negative():
    from hadpsgd.assembly.resume_config import differences
    from hadpsgd.cli import ConfigError, to_dict
    from hadpsgd.config import CheckpointConfig, parse_config

    saved = to_dict(parse_config([]))
    values, refused = differences(parse_config(["--keep-best", "4", "--batch-size", "16"]),
                                  saved)
    assert values["keep_best"] == 4 and [r.split()[0] for r in refused] == ["--batch-size"]
    with pytest.raises(ConfigError, match="--keep-best must be >= 0"):
        CheckpointConfig(keep_best=-1)


def test_a_state_of_views_is_saved_at_the_size_of_its_tensors():
    """Issue 44: parameters are views of the flat buffer, and on CUDA the LSTM's weights view a
    second storage aliasing it (cuDNN's layout): ``torch.save`` wrote every storage whole (311
    MB for swb's 173 MB). ``compact`` saves each tensor at its own size, with its values."""
    import io

    from hadpsgd.api.state import compact

    flat = torch.randn(10_000)
    alias = torch.from_dlpack(flat[1_000:])  # another storage over the same memory
    state = {"emb": flat[:1_000].view(10, 100), "w_ih": alias[:2_000].view(20, 100),
             "w_hh": alias[2_000:8_000], "step": 7}

    def saved(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getbuffer().nbytes, torch.load(io.BytesIO(buf.getvalue()))

    tensor_bytes = sum(v.numel() * 4 for v in state.values() if torch.is_tensor(v))
    loose, _ = saved(state)
    tight, back = saved(compact(state))
    assert loose > 1.5 * tensor_bytes  # both storages whole
    assert tight < 1.05 * tensor_bytes + 4096
    assert back["step"] == 7
    assert all(torch.equal(back[k], state[k]) for k in ("emb", "w_ih", "w_hh"))
    assert compact({"own": flat})["own"] is flat  # a whole storage is not copied
