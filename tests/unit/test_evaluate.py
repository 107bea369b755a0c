"""Held-out evaluation: the totals, accumulated on the model's device and read once."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F  # noqa: N812

from hadpsgd.data import ChunkDataset, make_loader
from hadpsgd.data.loader import IGNORE
from hadpsgd.data.sampler import ChunkBatchSampler
from hadpsgd.data.synth import SynthSpec, generate
from hadpsgd.models import build_model
from hadpsgd.train.evaluate import evaluate
from tests.fakes import OneLearner


def test_totals_equal_a_frame_by_frame_reference(tmp_path: Path) -> None:
    train, heldout = generate(tmp_path, SynthSpec(feat_dim=12, num_classes=5, train_utts=2,
                                                  heldout_utts=7, min_len=9, max_len=40))
    ds = ChunkDataset(heldout, chunk_len=8, expected_feat_dim=12)
    torch.manual_seed(0)
    model = build_model("tiny", 12, 5)
    topo = OneLearner()
    got = evaluate(model, ds, topo, batch_size=3)
    # Reference: every chunk at once, every counted frame once, in float64.
    x, y = ds.__getitems__(list(range(len(ds))))
    with torch.no_grad():
        logits = model(x).reshape(-1, 5).double()
    y = y.reshape(-1)
    keep = y != IGNORE
    assert got.frames == int(keep.sum()) == ds.file.num_frames
    ref_loss = F.cross_entropy(logits[keep], y[keep], reduction="sum").item() / got.frames
    ref_acc = (logits[keep].argmax(-1) == y[keep]).double().mean().item()
    assert abs(got.loss - ref_loss) < 1e-5 * ref_loss
    assert got.accuracy == ref_acc


def test_loader_pins_only_when_asked(tmp_path: Path) -> None:
    # The training loop and evaluation ask for page-locked batches on CUDA only.
    _, heldout = generate(tmp_path, SynthSpec(feat_dim=4, num_classes=3, train_utts=1,
                                              heldout_utts=2, min_len=9, max_len=12))
    ds = ChunkDataset(heldout, chunk_len=4)
    sampler = ChunkBatchSampler(len(ds), 2, 0, 1, seed=0)
    assert make_loader(ds, sampler).pin_memory is False
    assert make_loader(ds, sampler, pin_memory=True).pin_memory is True
