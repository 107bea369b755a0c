"""Your own model, loss and loop under hadpsgd: a TDNN-attention encoder trained with CTC.

Nothing here is hadpsgd's BLSTM, frame cross-entropy or training loop: the model, the loss,
the dataset wrapper and the loop are this script's, and hadpsgd adds one object made once
(``hadpsgd.Distributed``), one call per step (``dist.step(loss)``), a sampler for the
``DataLoader`` and a state for the checkpoint. Run it with each algorithm::

    mpirun -np 4 python examples/own_model.py --algo ssgd
    HADPSGD_RANKS_PER_NODE=2 mpirun -np 4 python examples/own_model.py --algo bmuf
    HADPSGD_RANKS_PER_NODE=2 mpirun -np 4 python examples/own_model.py --algo adpsgd

(``HADPSGD_RANKS_PER_NODE=2`` makes two emulated nodes of two learners: BMUF and ADPSGD work
across nodes, so on one machine they need it to be more than SSGD.) Without ``--train`` /
``--heldout`` it trains on hadpsgd's synthetic default feature set (generated once and cached,
as ``python -m hadpsgd.run`` does); the CTC targets are its frame labels with repeats collapsed.

At the end rank 0 prints the held-out error of greedy CTC decoding over whole utterances: on
the real-audio digit set (``python examples/digits/build.py DIR``, then ``--train
DIR/train.h5 --heldout DIR/heldout.h5``) the word error rate against the digits each
utterance id ends with; on other data (the synthetic set has no words) the label error rate
against the collapsed frame labels. Scoring needs kaldialign (``pip install
'hadpsgd[examples]'``); without it the line says so.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, Dataset

import hadpsgd
from hadpsgd.comm import WIRES
from hadpsgd.data import ChunkDataset

BLANK = 0
"""CTC's blank symbol; label ``c`` of the file is symbol ``c + 1``."""
DIGIT_CLASSES, STATES_PER_DIGIT, SILENCE = 31, 3, 30
"""The digit set's layout (examples/digits): digit d is classes 3d..3d+2, silence is 30."""
DIGITS_AT_END = re.compile(r"-(\d+)$")
"""A digit-set utterance id ends with what it says: ``ho003-en-gb-x-gbclan+f3-012-4821``."""


class Encoder(nn.Module):
    """Dilated TDNN (1-d convolutions) layers and one self-attention block, then CTC outputs."""

    def __init__(self, feat_dim: int, num_labels: int, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(feat_dim, hidden)
        self.tdnn = nn.ModuleList(nn.Conv1d(hidden, hidden, 3, padding=d, dilation=d)
                                  for d in (1, 2, 3))
        self.norm = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.out = nn.Linear(hidden, num_labels + 1)  # + the blank

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """``[batch, time, feat_dim]`` -> ``[batch, time, num_labels + 1]`` logits."""
        h = F.relu(self.inp(feats))
        for conv in self.tdnn:
            h = h + F.relu(conv(h.transpose(1, 2))).transpose(1, 2)
        a = self.norm(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        return self.out(h)


class CTCChunks(Dataset):
    """Fixed-length chunks of an HDF5 feature file, each with its CTC label sequence."""

    def __init__(self, path: str | Path, chunk_len: int) -> None:
        # Whole chunks only: every frame of a chunk is labelled, so its collapsed label
        # sequence is what the chunk says.
        self.chunks = ChunkDataset(path, chunk_len, cover_tails=False)
        self.feat_dim, self.num_labels = self.chunks.feat_dim, self.chunks.num_classes

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A batch: features, padded targets (symbols from 1) and target lengths."""
        feats, labels = self.chunks.__getitems__(indices)
        new = torch.ones_like(labels, dtype=torch.bool)
        new[:, 1:] = labels[:, 1:] != labels[:, :-1]  # the first frame of each label run
        lengths = new.sum(dim=1)
        targets = torch.zeros_like(labels)
        for b in range(len(labels)):
            targets[b, :lengths[b]] = labels[b][new[b]] + 1
        return feats, targets, lengths


def as_is(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The loader's collate: ``__getitems__`` already made the batch."""
    return batch


def ctc_loss(logits: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
    """CTC over every frame of each chunk (the log-softmax in fp32 whatever the precision)."""
    log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # [time, batch, symbols]
    frames = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, targets, frames, lengths, blank=BLANK, reduction=reduction,
                      zero_infinity=True)


def heldout_loss(dist: hadpsgd.Distributed, data: CTCChunks, batch: int = 64) -> float:
    """The held-out CTC loss per chunk of the evaluation model, over every learner's share."""
    topo = dist.topology
    totals = torch.zeros(2, dtype=torch.float64)
    mine = list(range(topo.rank, len(data), topo.size))
    with dist.evaluation_model() as model, torch.no_grad():
        model.eval()
        for i in range(0, len(mine), batch):
            feats, targets, lengths = data.__getitems__(mine[i:i + batch])
            with dist.autocast():
                logits = model(feats.to(topo.device))
            totals[0] += float(ctc_loss(logits, targets.to(topo.device), lengths, "sum"))
            totals[1] += len(lengths)
        model.train()
    topo.allreduce_(totals, op="sum")
    return float(totals[0] / totals[1])


def greedy_classes(logits: torch.Tensor) -> list[int]:
    """CTC greedy decoding of ``[time, symbols]`` logits to file classes.

    The best symbol per frame, runs of one symbol merged, blanks dropped.
    """
    best = logits.argmax(-1)
    new = torch.ones_like(best, dtype=torch.bool)
    new[1:] = best[1:] != best[:-1]
    return [int(s) - 1 for s in best[new & (best != BLANK)]]


def digit_words(classes: Sequence[int]) -> list[str]:
    """The digit words of a class sequence.

    A word starts where a digit's first state (class 3d) follows anything else; 3d twice in
    a row is one word (its state run split by a blank).
    """
    return [str(c // STATES_PER_DIGIT) for i, c in enumerate(classes)
            if c != SILENCE and c % STATES_PER_DIGIT == 0 and (i == 0 or classes[i - 1] != c)]


def heldout_errors(dist: hadpsgd.Distributed, data: CTCChunks) -> tuple[str, int, int] | None:
    """Greedy CTC over each whole held-out utterance, scored with kaldialign (collective).

    Returns ``("WER", errors, words)`` on the digit set (31 classes, ids ending in their
    digits), else ``("label error rate", errors, labels)`` against the collapsed frame
    labels; ``None`` without kaldialign. Each learner decodes every size-th utterance.
    """
    try:
        import kaldialign
    except ImportError:
        return None
    topo, file = dist.topology, data.chunks.file
    words = file.num_classes == DIGIT_CLASSES and all(map(DIGITS_AT_END.search, file.utt_ids))
    totals = torch.zeros(2, dtype=torch.float64)  # edit errors, reference tokens
    with dist.evaluation_model() as model, torch.no_grad():
        model.eval()
        for u in range(topo.rank, len(file.utt_ids), topo.size):
            feats, labels = file.read(file.offsets[u], file.offsets[u + 1])
            with dist.autocast():
                logits = model(torch.from_numpy(feats)[None].to(topo.device))[0]
            hyp: Sequence[object] = greedy_classes(logits.float().cpu())
            if words:
                ref: Sequence[object] = list(DIGITS_AT_END.search(file.utt_ids[u])[1])
                hyp = digit_words(hyp)
            else:
                ref = [int(c) for i, c in enumerate(labels) if i == 0 or c != labels[i - 1]]
            totals += torch.tensor([kaldialign.edit_distance(ref, hyp)["total"], len(ref)],
                                   dtype=torch.float64)
        model.train()
    topo.allreduce_(totals, op="sum")
    return ("WER" if words else "label error rate"), int(totals[0]), int(totals[1])


def data_paths(args: argparse.Namespace, topo: hadpsgd.Topology) -> tuple[str, str]:
    """``--train`` / ``--heldout``, or hadpsgd's synthetic default set (rank 0 makes it)."""
    if args.train and args.heldout:
        return args.train, args.heldout
    paths = None
    if topo.rank == 0:
        from hadpsgd.data.synth import SynthSpec, default_dataset

        paths = tuple(str(p) for p in default_dataset(spec=SynthSpec()))
    return tuple(topo.bcast_object(paths, root=0))


def main() -> None:
    """Parse, train, evaluate, save."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="ssgd", choices=["ssgd", "bmuf", "adpsgd"])
    parser.add_argument("--train", help="training HDF5 feature file (default: synthetic)")
    parser.add_argument("--heldout", help="held-out HDF5 feature file (default: synthetic)")
    # Ten: on the synthetic default set two epochs left greedy CTC at a 94 % label error
    # rate (it had learned little beyond blanks), ten reach ~45-55 % in well under a minute.
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="chunks per learner")
    parser.add_argument("--chunk-len", type=int, default=21)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--sync-period", type=int, default=4, help="BMUF's tau")
    parser.add_argument("--wire", default="fp32", choices=WIRES,
                        help="BMUF's block sync / ADPSGD's gossip on the link between nodes")
    parser.add_argument("--adam-moments", default=None,
                        help="BMUF: what a sync does with Adam's moments (corrected, "
                        "average, local, reset); default: BMUF-Adam's recipe")
    parser.add_argument("--block-momentum", type=float, default=None,
                        help="BMUF's block momentum (default: its recipe's)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save", help="write a checkpoint here at the end")
    parser.add_argument("--resume", help="continue from a checkpoint written by --save")
    parser.add_argument("--run-dir", help="keep config.json and metrics.jsonl here, as the "
                        "CLI's --out-dir (python -m hadpsgd.plot RUN_DIR draws them)")
    args = parser.parse_args()

    topo = hadpsgd.init()  # HADPSGD_RANKS_PER_NODE emulates nodes on one machine
    train_path, heldout_path = data_paths(args, topo)
    train, heldout = CTCChunks(train_path, args.chunk_len), CTCChunks(heldout_path,
                                                                      args.chunk_len)
    torch.manual_seed(args.seed)  # rank 0's initial weights are broadcast to every learner
    model = Encoder(train.feat_dim, train.num_labels, args.hidden).to(topo.device)
    # BMUF-Adam's recipe (the paper's beta1 0.5); Adam as usual for the others.
    betas = (0.5, 0.999) if args.algo == "bmuf" else (0.9, 0.999)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=betas)
    options: dict[str, object] = {} if args.wire == "fp32" else {"wire": args.wire}
    if args.algo == "bmuf":
        options["sync_period"] = args.sync_period
        for name in ("adam_moments", "block_momentum"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)

    with hadpsgd.Distributed(model, optimizer, args.algo, topology=topo,
                             precision=args.precision, run_dir=args.run_dir,
                             log_every=args.log_every, **options) as dist:
        sampler = dist.sampler(len(train), args.batch_size, seed=args.seed)
        loader = DataLoader(train, batch_sampler=sampler, collate_fn=as_is)
        if args.resume:
            dist.load_state_dict(torch.load(args.resume, weights_only=True)["hadpsgd"])
        first = heldout_loss(dist, heldout)
        dist.record_eval(first)  # into --run-dir's metrics.jsonl (nothing without one)
        start = time.perf_counter()
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)  # ADPSGD's learners meet here (they end epochs apart)
            for feats, targets, lengths in loader:
                with dist.autocast():
                    logits = dist.model(feats.to(topo.device))
                loss = ctc_loss(logits, targets.to(topo.device), lengths)
                dist.zero_grad()
                dist.scale(loss).backward()
                result = dist.step(loss)
                if topo.rank == 0 and dist.steps % args.log_every == 0:
                    figures = dist.metrics()
                    print(f"[own_model] epoch {epoch} step {dist.steps}: loss "
                          f"{result.loss:.4f}, {figures['grad_wire_bytes'] / 2**20:.2f} MiB of "
                          f"gradients, {figures.get('wire_bytes', 0) / 2**20:.2f} MiB across "
                          "nodes", flush=True)
        dist.finish()  # BMUF: the last partial block into the global model
        last = heldout_loss(dist, heldout)
        dist.record_eval(last)
        if args.save:
            # Collective. A small model: rank 0's dict holds every node's part, one file.
            # A large one: state_dict() (each node's own part), saved by every node leader.
            state = dist.state_dict(gather=True)
            if topo.rank == 0:
                torch.save({"hadpsgd": state, "args": vars(args)}, args.save)
        steps = topo.gather_object(dist.steps)
        if topo.rank == 0:
            print(f"[own_model] {args.algo} on {topo.size} learners ({topo.num_nodes} nodes): "
                  f"held-out CTC loss {first:.4f} -> {last:.4f}, steps per learner {steps}, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        began = time.perf_counter()
        scored = heldout_errors(dist, heldout)
        if topo.rank == 0:
            if scored is None:
                print("[own_model] held-out errors not scored: pip install "
                      "'hadpsgd[examples]' (kaldialign)", flush=True)
            else:
                name, errors, total = scored
                print(f"[own_model] held-out {name} {100 * errors / total:.2f} % [{errors} / "
                      f"{total}] (greedy CTC, whole utterances; "
                      f"{time.perf_counter() - began:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
