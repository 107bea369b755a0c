"""ADPSGD's options (``--algo adpsgd``): the super-learners, staleness, CHOCO's step, the graph.

With the wire facts ADPSGD reads (:data:`CHOCO_WIRES`, from the wire table) and the format
the evaluation average crosses in (:func:`average_wire`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hadpsgd.algorithms.choco import DEFAULT_GOSSIP_STEP
from hadpsgd.algorithms.gossip import GRAPHS
from hadpsgd.algorithms.options import WireOptions
from hadpsgd.cli import ConfigError
from hadpsgd.comm.codec import FORMATS

CHOCO_WIRES: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.differences)
"""The wires whose gossip is CHOCO-SGD's compressed differences (and reads --gossip-step):
the wire table's ``differences`` (:data:`hadpsgd.comm.codec.FORMATS`)."""

CHOCO_HELD_UP_TO = 4
"""Super-learners up to which CHOCO's compressed gossip trained (speechocean762, FSDD): past
them it is said at start (:meth:`ADPSGDOptions.many_learners_warning`)."""
@dataclass(frozen=True)
class ADPSGDOptions(WireOptions):
    """ADPSGD / H-ADPSGD options."""

    super_learner_size: int | None = None
    """ADPSGD: learners per super-learner (consecutive ranks; 1 = flat ADPSGD); default: the
    nodes. The same setting as --ranks-per-node (a super-learner is a node): give one."""
    max_staleness: int = 0
    """ADPSGD: a learner more than this many local steps past the snapshot of its exchange in
    flight waits for that exchange and applies it before stepping on (0: never wait)."""
    gossip_step: float = DEFAULT_GOSSIP_STEP
    """ADPSGD with --wire topk, sign or signtopk: CHOCO-SGD's consensus step gamma in (0, 1]:
    each exchange moves a model gamma / 2 of the way to its partner's estimate (1: as plain
    gossip, which lost the model with top-k; 0.2, the default, was the best measured:
    docs/results.md)."""
    gossip_graph: str | None = field(default=None, metadata={"choices": GRAPHS})
    """ADPSGD: who pairs with whom among the super-learners: ring (the h-adpsgd paper: a
    neighbour on either side) or exponential (at distance 1, 2, 4, ...: mixes in ~log N
    exchanges where a ring of N takes ~N**2; the complete graph up to 4 super-learners).
    Default: exponential (16 flat learners on the ring ended 1.9 WER points behind SSGD on
    speechocean762, on it 0.1 behind: docs/results.md); ring with --wire topk, sign or
    signtopk, whose CHOCO estimates are kept per edge and were measured on the ring."""
    eval_model: str | None = field(default=None, metadata={"choices": ("average", "replicas")})
    """ADPSGD: what an epoch's held-out evaluation and checkpoint take: average (the replicas'
    mean, one model across the nodes each time: int8 on a compressed wire) or replicas (each
    learner scores its share of the held-out set with its own replica, and nothing but the
    sums crosses; the run's end still averages them, in fp32, into the deployed model).
    Default: replicas with --wire topk, sign or signtopk (a slow link, where an epoch's
    average weighed as much as the gossip: docs/benchmarks.md), else average."""
    sync_buffers: bool = True
    """Keep the model's buffers (BatchNorm's running statistics) in agreement: ssgd takes
    rank 0's after every step (DDP's broadcast_buffers), bmuf and adpsgd average the
    floating-point ones (integer ones: rank 0's); --no-sync-buffers leaves each learner its
    own (docs/api.md, Buffers)."""

    # CHOCO-SGD's consensus step is read by the compressed gossip only (the comment of
    # WireOptions.wire_readers).
    wire_readers: ClassVar[dict[str, tuple[str, ...]]] = {
        **WireOptions.wire_readers, "gossip_step": CHOCO_WIRES}

    def many_learners_warning(self, super_learners: int) -> str | None:
        """What to say when CHOCO's compressed gossip runs on more super-learners than held.

        Measured on speechocean762 at 16 flat learners (8 chunks each, docs/results.md):
        ``--wire topk`` diverged on 3 of 3 seeds, with ``--gossip-step 0.05`` too, and with
        the gradient clipped to norm 1 it trained to 82.7 % WER where SSGD reached 70.9 (seed
        0); ``--wire sign`` diverged on 3 of 3 seeds too (2026-12-04: the training loss
        9e6 by step 80). Each learner steps alone at the world's rate on 1/N of the batch,
        and compressed differences on the ring do not hold the replicas together as fp32
        gossip does (which matched SSGD there). A lower rate stops the divergence but not
        the loss (2026-12-05, seed 0, SSGD 68.6 %): sign at ``--lr 0.25`` trained to 81.3 %
        on the ring and 78.2 % on the exponential graph; the world's rate after a first
        epoch at half of it (``--warmup-epochs 2``) 91.5 %; ``--gossip-step 1`` and the
        exponential graph at the world's rate diverged by step ~60. At 4 both trained: topk
        2 points behind fp32 gossip, sign at its WER (FSDD, the espeak set), and 16
        learners as 4 nodes of 4 trained with topk, +1.01 ± 0.49 against SSGD (3 seeds, 8
        epochs, 2026-12-06). None up to 4 super-learners or for a dense wire.
        """
        if self.wire not in CHOCO_WIRES or super_learners <= CHOCO_HELD_UP_TO:
            return None
        return (f"adpsgd --wire {self.wire} on {super_learners} super-learners: CHOCO's "
                f"compressed gossip was measured to hold up to {CHOCO_HELD_UP_TO}; on "
                "speechocean762 at 16 topk and sign both diverged on every seed (topk also "
                "with --gossip-step 0.05; with --max-grad-norm 1 it ended 12 WER points "
                "behind SSGD; sign at --lr 0.25 trained, 10-13 points behind). At "
                "this size gossip a dense wire (--wire int8, bf16 or fp32) or use --algo bmuf "
                "--wire sign (127x fewer bytes than SSGD at 16 workers, near its WER), or put "
                "learners that share a fast link in one node (--ranks-per-node, hosts of "
                "several): 16 learners as 4 nodes of 4 trained with topk, 1.0 WER points "
                "behind SSGD")

    def __post_init__(self) -> None:
        if self.super_learner_size is not None and self.super_learner_size < 1:
            raise ConfigError(f"{self.flag('super_learner_size')} must be > 0 (1 = flat ADPSGD), "
                              f"got {self.super_learner_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"{self.flag('max_staleness')} must be >= 0 (0 = unbounded), got "
                              f"{self.max_staleness}")
        self.check_wire()
        if not 0.0 < self.gossip_step <= 1.0:
            raise ConfigError(f"{self.flag('gossip_step')} must be in (0, 1] (CHOCO's consensus "
                              f"step; 1 mixes as plain gossip), got {self.gossip_step}")

    def graph(self) -> str:
        """The gossip graph in use: ``gossip_graph``, or its default for the wire."""
        if self.gossip_graph is not None:
            return self.gossip_graph
        return "ring" if self.wire in CHOCO_WIRES else "exponential"

    def ranks_per_node(self) -> int | None:
        """Super-learners are groups of this many consecutive ranks (emulated nodes)."""
        return self.super_learner_size

    def evaluates_average(self) -> bool:
        """Whether an epoch's evaluation takes the replicas' average (``eval_model``)."""
        if self.eval_model is not None:
            return self.eval_model == "average"
        return self.wire not in CHOCO_WIRES


def average_wire(wire: str) -> str:
    """The format of the evaluation average's difference on gossip wire ``wire``.

    bf16 keeps bf16; every coarser wire takes int8 (one scale per 1,024 values): the average
    is what is evaluated and deployed, so it is never sent in fewer than 8 bits a value.
    """
    return "bf16" if wire == "bf16" else "int8"


__all__ = ["CHOCO_HELD_UP_TO", "CHOCO_WIRES", "ADPSGDOptions", "average_wire"]
