"""Every algorithm on speechocean762, in words on unseen speakers: the study of issue 56.

usage: python examples/speechocean/study.py BUILD RUNS [--configs single,ssgd,...]
           [--workers 4,16] [--seeds 0,1,2] [--epochs 2] [--preset small] [--batch-size 8]
           [--test-every 4] [--scales 0.15,0.2,0.25] [--prior-scales 1] [--beam 12]
           [--max-active 3000] [--redecode] [--results results.jsonl]
       python examples/speechocean/study.py BUILD RUNS --report [--results results.jsonl]

BUILD is what ``build.py`` wrote (``train.h5``, ``dev.h5``, ``test.h5``, ``*.text``,
``HCLG.fst``, ``words.txt``). Every cell (configuration x workers x seed) is the path a user
takes, one command after the other:

1. ``python -m hadpsgd.launch -n N -- --train BUILD/train.h5 --heldout BUILD/dev.h5 ...``
   (every learner its own emulated node, ``--ranks-per-node 1``, so that the bytes between
   nodes are counted; H-ADPSGD's super-learners are 2 ranks);
2. ``python -m hadpsgd.forward`` over the dev set and the test subset;
3. ``python -m hadpsgd.decode --graph BUILD/HCLG.fst`` on dev at each ``--scales`` and each
   ``--prior-scales`` (the forward's ``--prior-scale``: the priors' exponent in the hybrid's
   pseudo-likelihood); the pair with the lowest dev WER (never test's) decodes the test
   subset once. ``--redecode`` skips step 1 for runs already trained.

The test subset is every ``--test-every``-th utterance of ``test.h5`` in id order (ids start
with the speaker, so all 125 test speakers are in it: ~5 sentences each), written once to
``BUILD/test-every4.h5`` and its ``.text``: decoding the full test set costs 12 minutes on
this machine's cores, the subset a fifth of that. Each finished cell appends one JSON line to
``RUNS/results.jsonl``; a rerun skips the cells already there (resumable), and a crashed or
timed-out cell is recorded with its status and rerun next time. Several drivers may share
RUNS (each cell is claimed by one).

``--report`` prints, per configuration and worker count, the test WER by seed, its mean and
standard error, the paired difference against SSGD at the same seed, the held-out loss per
epoch, bytes between nodes per rank, and frames per second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

if __package__ in (None, ""):  # run as a file: make ``hadpsgd`` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.speechocean.frames import frame_stats  # noqa: E402
from hadpsgd.comm.signtopk import SIGNTOPK_CHUNK  # noqa: E402
from hadpsgd.data.writer import FeatureWriter  # noqa: E402

PROG = "examples/speechocean/study.py"


def _signtopk(k: int, tau: int, residual: str = "model", keep: str = "0.5",
              ranks_per_node: int = 1) -> list[str]:
    """A ``--wire signtopk`` config: ``k`` of each 4,096 values at block ``tau``.

    Every learner its own node unless ``ranks_per_node`` says otherwise. The model form
    takes back ``keep`` of each worker's rounding (the default's half unless said, pinned
    so the row reruns as it was); ``delta`` is error feedback (issue 57).
    """
    kept = ["--bmuf-residual-keep", keep] if residual == "model" else []
    return ["--algo", "bmuf", "--wire", "signtopk", "--topk-fraction", str(k / SIGNTOPK_CHUNK),
            "--sync-period", str(tau), "--ranks-per-node", str(ranks_per_node),
            "--bmuf-residual", residual, *kept]


#: name -> (learners: None for the worker count, 1 for the single learner; run.py options).
CONFIGS: dict[str, tuple[int | None, list[str]]] = {
    "single": (1, ["--algo", "ssgd"]),
    "ssgd": (None, ["--algo", "ssgd", "--ranks-per-node", "1"]),
    "bmuf": (None, ["--algo", "bmuf", "--ranks-per-node", "1"]),
    # The paper's synchronous warm-up over 10 % of an epoch's samples: 36 steps at the
    # study's global batch of 128 (4 x 32 and 16 x 8 chunks), at one worker's rate or the
    # world's.
    "bmuf-adam": (None, ["--algo", "bmuf", "--optimizer", "adam", "--ranks-per-node", "1",
                         "--bmuf-warmup-steps", "36"]),
    "bmuf-adam-wlr": (None, ["--algo", "bmuf", "--optimizer", "adam", "--ranks-per-node", "1",
                             "--bmuf-warmup-steps", "36", "--bmuf-warmup-lr", "world"]),
    # The defaults: the exponential gossip graph (ring of 16: 1.9 WER points behind SSGD).
    "adpsgd": (None, ["--algo", "adpsgd", "--ranks-per-node", "1"]),
    "hadpsgd": (None, ["--algo", "adpsgd", "--ranks-per-node", "2"]),
    "bmuf-sign": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node", "1"]),
    "bmuf-int4": (None, ["--algo", "bmuf", "--wire", "int4", "--ranks-per-node", "1"]),
    "adpsgd-topk": (None, ["--algo", "adpsgd", "--wire", "topk", "--ranks-per-node", "1"]),
    # CHOCO's other code: every value's sign, 1 bit (topk sends 1/64 of them) (issue 57).
    "adpsgd-sign": (None, ["--algo", "adpsgd", "--wire", "sign", "--ranks-per-node", "1"]),
    # CHOCO's consensus step a quarter of its default (diverged at 0.2 on 16 workers).
    "adpsgd-topk-g005": (None, ["--algo", "adpsgd", "--wire", "topk", "--ranks-per-node", "1",
                                "--gossip-step", "0.05"]),
    # ... and with the worker's gradient clipped to norm 1 (as BMUF's SGD recipe is: a
    # learner steps alone at the world's rate on 1/N of its batch between weak exchanges).
    "adpsgd-topk-clip1": (None, ["--algo", "adpsgd", "--wire", "topk", "--ranks-per-node",
                                 "1", "--max-grad-norm", "1"]),
    # CHOCO's gossip at 16 learners with half the world's rate: each learner steps nearly
    # alone on 1/16 of the batch between weak exchanges (diverged at 0.5 by step ~60).
    "adpsgd-sign-lr025": (None, ["--algo", "adpsgd", "--wire", "sign", "--ranks-per-node", "1",
                                 "--lr", "0.25"]),
    "adpsgd-sign-lr025-exp": (None, ["--algo", "adpsgd", "--wire", "sign", "--ranks-per-node",
                                     "1", "--lr", "0.25", "--gossip-graph", "exponential"]),
    "adpsgd-sign-warm2": (None, ["--algo", "adpsgd", "--wire", "sign", "--ranks-per-node", "1",
                                 "--warmup-epochs", "2"]),
    # What the 16-worker gap was measured with: the paper's ring (ADPSGD's default before),
    # BMUF's tau 8 at every worker count (its default before), the worker's clip halved and
    # doubled (not the cause), tau 4 (the default at 16 now, given by hand).
    "adpsgd-ring": (None, ["--algo", "adpsgd", "--ranks-per-node", "1", "--gossip-graph",
                           "ring"]),
    "bmuf-tau8": (None, ["--algo", "bmuf", "--ranks-per-node", "1", "--sync-period", "8"]),
    "bmuf-tau4": (None, ["--algo", "bmuf", "--ranks-per-node", "1", "--sync-period", "4"]),
    "bmuf-clip2": (None, ["--algo", "bmuf", "--ranks-per-node", "1", "--max-grad-norm", "2"]),
    "bmuf-clip05": (None, ["--algo", "bmuf", "--ranks-per-node", "1", "--max-grad-norm", "0.5"]),
    # The sign recipe's gap (issue 57), taken apart: its tau 40 with fp32 deltas, and its
    # sign code at the default tau 8.
    "bmuf-tau40": (None, ["--algo", "bmuf", "--ranks-per-node", "1", "--sync-period", "40"]),
    "bmuf-sign-tau8": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node", "1",
                              "--sync-period", "8"]),
    # The sign recipe at 16 workers (93 % WER at tau 40): its block shortened as fp32's
    # default is (x sqrt(4/N): 20 at 16).
    "bmuf-sign-tau20": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node", "1",
                               "--sync-period", "20"]),
    # The wires at fp32's own block (issue 57's fix: tau 8 up to 4 workers, 4 at 16).
    "bmuf-sign-tau4": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node", "1",
                              "--sync-period", "4"]),
    "bmuf-int4-tau8": (None, ["--algo", "bmuf", "--wire", "int4", "--ranks-per-node", "1",
                              "--sync-period", "8"]),
    "bmuf-int4-tau4": (None, ["--algo", "bmuf", "--wire", "int4", "--ranks-per-node", "1",
                              "--sync-period", "4"]),
    # Issue 57's budget (>= 1,000x): sign at a block of 32 with a block momentum of 0.5
    # (the SGD recipe's is 0; on FSDD fold A 0.5 took tau 32 from 9.53 to 7.60 % WER, SSGD's
    # 8.47; on folds A, C and D 11.41 against SSGD's 12.71, 3 seeds each).
    "bmuf-sign-tau32-bm05": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node",
                                    "1", "--sync-period", "32", "--block-momentum", "0.5"]),
    # The bytes-WER curve between BMUF's own block (tau 8, 254x) and the budget's (tau 32,
    # 1,019x): tau 16, 509x (issue 57, 8 epochs; also run at --batch-size 64, where it is
    # 1,019x against SSGD at the study's batch but 509x against SSGD at its own).
    "bmuf-sign-tau16-bm05": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node",
                                    "1", "--sync-period", "16", "--block-momentum", "0.5"]),
    # The budget's block with half the workers' rate and a block rate making up for it
    # (DiLoCo's outer rate): less drift in a block, the same step (issue 57, not kept).
    "bmuf-sign-tau32-lrh-z2": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node",
                                      "1", "--sync-period", "32", "--block-momentum", "0.5",
                                      "--lr", "0.25", "--block-lr", "2"]),
    "bmuf-sign-tau32-lrh-z4": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node",
                                      "1", "--sync-period", "32", "--block-momentum", "0",
                                      "--lr", "0.25", "--block-lr", "4"]),
    # ... and the same block in fp32 (issue 57, 8 epochs): what the block itself costs,
    # apart from the 1-bit code.
    "bmuf-tau32-bm05": (None, ["--algo", "bmuf", "--ranks-per-node", "1", "--sync-period",
                               "32", "--block-momentum", "0.5"]),
    # The BMUF paper's classic block at 1 bit (the single learner's rate, block momentum
    # 1 - 1/N): too few blocks in 2 epochs of FSDD; tried at 8 epochs here (issue 57).
    "bmuf-sign-tau32-classic": (None, ["--algo", "bmuf", "--wire", "sign", "--ranks-per-node",
                                       "1", "--sync-period", "32", "--bmuf-worker-lr",
                                       "single"]),
    # Issue 57: the wire's rounding kept in the worker's model (--bmuf-residual model), so
    # a sub-bit code at a short block redoes no progress: top-k at 1,089x (+1.66 against
    # SSGD, 3 seeds, 8 epochs), sign at BMUF's block (-0.12 at 4 workers over 2 seeds, +0.27
    # at 16 over 3, against error feedback).
    "bmuf-topk128-tau4-keep": (None, ["--algo", "bmuf", "--wire", "topk", "--topk-fraction",
                                      "0.0078125", "--sync-period", "4", "--ranks-per-node",
                                      "1", "--bmuf-residual", "model",
                                      "--bmuf-residual-keep", "1"]),
    "bmuf-sign-tau8-keep": (None, ["--algo", "bmuf", "--wire", "sign", "--sync-period", "8",
                                   "--ranks-per-node", "1", "--bmuf-residual", "model",
                                   "--bmuf-residual-keep", "1"]),
    "bmuf-sign-tau4-keep": (None, ["--algo", "bmuf", "--wire", "sign", "--sync-period", "4",
                                   "--ranks-per-node", "1", "--bmuf-residual", "model",
                                   "--bmuf-residual-keep", "1"]),
    # Issue 57: the signs of each 4,096 values' largest 112 with their places packed
    # (--wire signtopk, 8 bits a chosen value) at a block of 8, the rounding kept in the
    # worker's model: 1,092x fewer bytes than SSGD fp32, +0.90 +- 0.22 WER (13 runs, 8 ep).
    "bmuf-signtopk-tau8-keep": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                       "--sync-period", "8", "--ranks-per-node", "1",
                                       "--bmuf-residual", "model", "--bmuf-residual-keep", "1"]),
    # ... each worker at half the global rate with block momentum 0.5: the same steady-state
    # step (0.25 / (1 - 0.5)), the block momentum filtering the rounding over syncs, and
    # half the rounding kept in each worker's model (issue 57).
    "bmuf-signtopk-tau8-keep-half": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                            "--sync-period", "8", "--ranks-per-node", "1",
                                            "--bmuf-residual", "model",
                                            "--bmuf-residual-keep", "1", "--lr", "0.25",
                                            "--block-momentum", "0.5"]),
    # ... and at one learner's rate with block momentum 1 - 1/N (the BMUF papers' form; the
    # same steady-state step again, a quarter of the rounding kept at 4 workers; issue 57).
    "bmuf-signtopk-tau8-keep-single": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                              "--sync-period", "8", "--ranks-per-node", "1",
                                              "--bmuf-residual", "model",
                                              "--bmuf-residual-keep", "1",
                                              "--bmuf-worker-lr", "single"]),
    # ... the workers at the global rate, the block's update filtered instead: block
    # momentum 0.5 and block learning rate 0.5 (the same steady-state step; issue 57).
    "bmuf-signtopk-tau8-keep-bm05": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                            "--sync-period", "8", "--ranks-per-node", "1",
                                            "--bmuf-residual", "model",
                                            "--bmuf-residual-keep", "1", "--block-momentum",
                                            "0.5", "--block-lr", "0.5"]),
    # ... half of each worker's rounding taken back into its model, half error feedback
    # (the half rate's halved rounding at the global rate; issue 57 screen).
    "bmuf-signtopk-tau8-keep-split": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                             "--sync-period", "8", "--ranks-per-node", "1",
                                             "--bmuf-residual", "model",
                                             "--bmuf-residual-keep", "0.5"]),
    # ... with error feedback instead (--bmuf-residual delta), the form that moved signtopk
    # at 16 workers, tried at 4 (issue 57).
    "bmuf-signtopk-tau8-ef": (None, ["--algo", "bmuf", "--wire", "signtopk", "--sync-period",
                                     "8", "--ranks-per-node", "1", "--bmuf-residual", "delta"]),
    # ... the same bytes a step spent on a longer or a shorter block (issue 57): 192 of
    # 4,096 at tau 12 (1,070x: Elias-Fano's places cost less at a higher share, so 16 values
    # a step against 14; +0.83 on 2 seeds) and 84 at tau 6 (1,033x, 14 a step; +0.60 +- 0.13
    # over 11 runs, no different from tau 8 on the same seeds).
    "bmuf-signtopk192-tau12-keep": (None, _signtopk(192, 12, keep="1")),
    "bmuf-signtopk84-tau6-keep": (None, _signtopk(84, 6, keep="1")),
    # ... and at a block of 4 with 48 of 4,096 (~1,025x at 16 workers, BMUF's block there):
    # 67.33 % against SSGD's 61.74 at 16 workers, 8 epochs, seed 0 (issue 57).
    "bmuf-signtopk48-tau4-keep": (None, _signtopk(48, 4, keep="1")),
    # ... with error feedback instead (--bmuf-residual delta: each worker restarts from the
    # global model, its rounding joins its next delta): at 16 workers, 8 epochs, seeds 0-4,
    # +1.24 +- 0.40 against SSGD where the model form was +5.6 (seed 0): the default above 4
    # workers since (issue 57).
    "bmuf-signtopk48-tau4-ef": (None, _signtopk(48, 4, "delta")),
    # ... at the same bytes a step on a block of 2 (20 of 4,096), error feedback (issue 57).
    "bmuf-signtopk20-tau2-ef": (None, _signtopk(20, 2, "delta")),
    # ... with each worker at one learner's rate and block momentum 1 - 1/N (the BMUF papers'
    # form): a worker's rounding kept in its model is then 1/N of the global rate's. At 16
    # workers, 2 epochs, seed 1 it diverged (99.5 % WER; the global rate's 76.7, SSGD 66.6).
    "bmuf-signtopk48-tau4-keep-single": (None, [*_signtopk(48, 4, keep="1"),
                                                "--bmuf-worker-lr", "single"]),
    # ... twice and four times the share at the same block (611x and 353x at 16 workers):
    # does a larger share close the 16-node gap at all? (issue 57 screen)
    "bmuf-signtopk92-tau4-ef": (None, _signtopk(92, 4, "delta")),
    "bmuf-signtopk184-tau4-ef": (None, _signtopk(184, 4, "delta")),
    # ... top-k's 2-bit values in the place of signs, at its default's bytes a step.
    "bmuf-topk": (None, ["--algo", "bmuf", "--wire", "topk", "--ranks-per-node", "1"]),
    # The slow-link recipe as a user types it: every default (the block, the share that
    # follows it, the rounding's place) left to BMUF.
    "bmuf-signtopk": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node", "1"]),
    # ... a quarter of each worker's rounding taken back into its model, the rest error
    # feedback (issue 57 screen at 16 workers, where the whole of it in the model lost).
    "bmuf-signtopk-keep25": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node",
                                    "1", "--bmuf-residual", "model",
                                    "--bmuf-residual-keep", "0.25"]),
    # ... the workers at half the global rate with block momentum 0.5 (the same steady-state
    # step), error feedback as the default there: the lever that moved read speech most at 4
    # nodes, untried at 16 (issue 57): 1.06 behind the default on seed 0, stopped.
    "bmuf-signtopk-half": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node",
                                  "1", "--lr", "0.25", "--block-momentum", "0.5"]),
    # The recipe's own block and share for the workers (tau 6 and 76 of 4,096 at 8), with
    # the rounding's place chosen: where the model form's line between 4 and 16 sits.
    "bmuf-signtopk-model": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node",
                                   "1", "--bmuf-residual", "model", "--bmuf-residual-keep", "1"]),
    "bmuf-signtopk-delta": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node",
                                   "1", "--bmuf-residual", "delta"]),
    # 16 learners as 4 nodes of 4 (a slow link between the nodes, NCCL's inside): the
    # recipe between 4 super-learners, and SSGD over the same nodes for its bytes.
    "bmuf-signtopk-rpn4": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node",
                                  "4"]),
    # ... taking all of each worker's rounding back, the default before 2026-12-07.
    "bmuf-signtopk-rpn4-keep1": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                        "--ranks-per-node", "4", "--bmuf-residual-keep", "1"]),
    # ... at BMUF's block of 4 between the 4 nodes (the share follows: 46 of 4,096, the same
    # bytes a step), where shorter blocks cost a little less past 4,000x at 4 nodes.
    "bmuf-signtopk-rpn4-tau4": (None, ["--algo", "bmuf", "--wire", "signtopk",
                                       "--ranks-per-node", "4", "--sync-period", "4"]),
    "bmuf-signtopk-rpn2": (None, ["--algo", "bmuf", "--wire", "signtopk", "--ranks-per-node",
                                  "2"]),
    # The bytes-WER curve past 1,000x at 4 nodes (issue 57, item 3), half of each worker's
    # rounding taken back as the default does: BMUF's block of 8 with 56 of 4,096 (~1,900x
    # a step), 28 (~3,200x), 22 (~3,900x) and 18 (~4,400x), and the ~4,400x spent on a
    # block of 16 (48).
    "bmuf-signtopk56-tau8": (None, _signtopk(56, 8)),
    "bmuf-signtopk28-tau8": (None, _signtopk(28, 8)),
    "bmuf-signtopk22-tau8": (None, _signtopk(22, 8)),
    "bmuf-signtopk18-tau8": (None, _signtopk(18, 8)),
    "bmuf-signtopk48-tau16": (None, _signtopk(48, 16)),
    # ... 18 of 4,096 with error feedback instead (each worker restarts from the global model).
    "bmuf-signtopk18-tau8-ef": (None, _signtopk(18, 8, "delta")),
    # ... and with three quarters of each worker's rounding taken back.
    "bmuf-signtopk18-tau8-keep75": (None, _signtopk(18, 8, keep="0.75")),
    # ... and a quarter (the half's WER on seed 0).
    "bmuf-signtopk18-tau8-keep25": (None, _signtopk(18, 8, keep="0.25")),
    # ... ~3,900x spent on shorter blocks: 15 of 4,096 at tau 6, 8 at tau 4.
    "bmuf-signtopk15-tau6": (None, _signtopk(15, 6)),
    "bmuf-signtopk8-tau4": (None, _signtopk(8, 4)),
    # Past 4,000x between 4 nodes of 4 (issue 57, item 3 at 16 workers): 20 of 4,096 at
    # BMUF's block of 8, half the rounding taken back (4,021x: 3.9x fewer bytes a sync
    # than the default's 112), and 56 (1,809x).
    "bmuf-signtopk20-tau8-rpn4": (None, _signtopk(20, 8, ranks_per_node=4)),
    "bmuf-signtopk56-tau8-rpn4": (None, _signtopk(56, 8, ranks_per_node=4)),
    "ssgd-rpn4": (None, ["--algo", "ssgd", "--ranks-per-node", "4"]),
    "adpsgd-topk-rpn4": (None, ["--algo", "adpsgd", "--wire", "topk", "--ranks-per-node",
                                "4"]),
    # Adam on a slow link (issue 57): Sync-Adam, and BMUF with Adam in the SGD recipe's shape
    # on the 1-bit code: the moments kept on each worker (only the model crosses), every
    # worker at the global rate, no block momentum, the worker's gradient clipped to 1.
    "ssgd-adam": (None, ["--algo", "ssgd", "--optimizer", "adam", "--ranks-per-node", "1"]),
    "bmuf-adam-sign-local": (None, ["--algo", "bmuf", "--optimizer", "adam", "--wire", "sign",
                                    "--adam-moments", "local", "--bmuf-worker-lr", "global",
                                    "--block-momentum", "0", "--max-grad-norm", "1",
                                    "--ranks-per-node", "1"]),
    # BMUF-Adam's gap at 16 workers: its recipe's tau 8 against tau 4 (as SGD's fix).
    "bmuf-adam-tau4": (None, ["--algo", "bmuf", "--optimizer", "adam", "--ranks-per-node", "1",
                              "--bmuf-warmup-steps", "36", "--sync-period", "4"]),
    "bmuf-adam-wlr-tau4": (None, ["--algo", "bmuf", "--optimizer", "adam", "--ranks-per-node",
                                  "1", "--bmuf-warmup-steps", "36", "--bmuf-warmup-lr", "world",
                                  "--sync-period", "4"]),
}


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("build", type=Path, help="build.py's output directory")
    p.add_argument("runs", type=Path, help="where the runs and results.jsonl go")
    p.add_argument("--configs", default="single,ssgd,bmuf,adpsgd",
                   help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--workers", default="4", help="comma-separated learner counts (4,16)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--epochs", type=int, default=2, help="epochs of every run (equal epochs)")
    p.add_argument("--preset", default="small", help="model preset of every run")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sub-sequences a learner a step (default: the run's own, 32)")
    p.add_argument("--test-every", type=int, default=4,
                   help="decode every k-th test utterance (1: the whole test set)")
    p.add_argument("--scales", default="0.15,0.2,0.25",
                   help="acoustic scales tried on dev (the best decodes test)")
    p.add_argument("--prior-scales", default="1",
                   help="exponents on the class priors tried on dev with every acoustic "
                        "scale (hadpsgd.forward --prior-scale; 1 divides by the priors)")
    p.add_argument("--beam", type=float, default=12.0, help="decoding beam")
    p.add_argument("--max-active", type=int, default=3000, help="decoding max active states")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a command may take")
    p.add_argument("--redecode", action="store_true",
                   help="no training: forward and decode the cells' trained runs again (with "
                        "another --prior-scales or --scales); pair with another --results")
    p.add_argument("--results", default="results.jsonl",
                   help="the file in RUNS that holds one row a finished cell (default "
                        "results.jsonl)")
    p.add_argument("--report", action="store_true", help="print the table and stop")
    return p


def test_subset(build: Path, every: int) -> tuple[Path, Path]:
    """``test.h5`` / ``test.text`` thinned to every ``every``-th utterance (written once)."""
    if every == 1:
        return build / "test.h5", build / "test.text"
    h5, text = build / f"test-every{every}.h5", build / f"test-every{every}.text"
    if h5.exists() and text.exists():
        return h5, text
    refs = dict(line.split(maxsplit=1) for line in (build / "test.text").read_text().splitlines()
                if line.strip())
    lines = []
    with h5py.File(build / "test.h5", "r") as f:
        offsets = f["offsets"][:]
        ids = [u.decode() if isinstance(u, bytes) else str(u) for u in f["utt_ids"][:]]
        silence = [int(c) for c in f.attrs.get("silence_classes", [])]
        with FeatureWriter(h5, int(f.attrs["feat_dim"]), int(f.attrs["num_classes"]),
                           silence_classes=silence) as w:
            for i in range(0, len(ids), every):
                a, b = int(offsets[i]), int(offsets[i + 1])
                w.append(ids[i], np.asarray(f["feats"][a:b]), np.asarray(f["labels"][a:b]))
                lines.append(f"{ids[i]} {refs[ids[i]].strip()}")
    text.write_text("\n".join(lines) + "\n")
    return h5, text


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    """Run ``cmd`` with its output in ``log``; its exit status (124 on timeout)."""
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def _forward(run: Path, feats: Path, out: Path, prior_scale: float, log: Path,
             args: argparse.Namespace) -> int:
    """``hadpsgd.forward`` of ``run`` over ``feats`` into ``out``; its exit status."""
    cmd = [sys.executable, "-m", "hadpsgd.forward", str(run), "--features", str(feats),
           "--out", str(out), "--overwrite", "--no-progress", "--prior-scale", f"{prior_scale:g}"]
    return _run(cmd, log, args.timeout)


def _decode(ll: Path, build: Path, refs: Path, scale: float, args: argparse.Namespace,
            out: Path, log: Path) -> dict[str, Any] | None:
    """Decode ``ll`` at ``scale``; the decoder's JSON record (None on failure)."""
    cmd = [sys.executable, "-m", "hadpsgd.decode", str(ll), "--graph", str(build / "HCLG.fst"),
           "--words", str(build / "words.txt"), "--refs", str(refs), "--acoustic-scale",
           str(scale), "--beam", str(args.beam), "--max-active", str(args.max_active),
           "--json", str(out), "--overwrite"]
    if _run(cmd, log, args.timeout) != 0:
        return None
    return json.loads(out.read_text())


def train_summary(run: Path) -> dict[str, Any]:
    """Held-out loss per epoch, bytes between nodes (rank 0), frames/s, from metrics.jsonl."""
    evals: dict[int, float] = {}
    fps, internode = [], 0.0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "eval":
            # The last evaluation of an epoch (the end of it), keyed by epochs completed.
            evals[int(row["epoch"])] = row["heldout_loss"]
        elif row.get("kind") == "train":
            fps.append(row.get("frames_per_s", 0.0))
            internode = max(internode, row.get("internode_bytes", 0.0) or 0.0)
        elif row.get("kind") == "bytes":  # the run's closing count: its last syncs too
            internode = max(internode, float(row.get("rank0_internode_bytes") or 0.0))
    return {"heldout_loss": [evals[k] for k in sorted(evals)],
            "frames_per_s": statistics.median(fps) if fps else None,
            "internode_bytes": internode}


def run_cell(config: str, workers: int, seed: int, args: argparse.Namespace,
             test: tuple[Path, Path]) -> dict[str, Any]:
    """Train, forward and decode one cell; its result row."""
    learners, options = CONFIGS[config]
    n = learners or workers
    run = args.runs / f"{config}-w{workers}-s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    log = run / "study.log"
    row: dict[str, Any] = {"config": config, "workers": workers, "learners": n, "seed": seed,
                           "epochs": args.epochs, "preset": args.preset,
                           "batch_size": args.batch_size, "run": str(run)}
    start = time.time()
    if args.redecode:  # the trained run as it is: only forward and decoding again
        if not (run / "metrics.jsonl").is_file() or not (run / "checkpoints").is_dir():
            return {**row, "status": "not trained (--redecode decodes trained runs only)"}
    else:
        cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(n), "--",
               "--train", str(args.build / "train.h5"), "--heldout", str(args.build / "dev.h5"),
               *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
               "--preset", args.preset, "--epochs", str(args.epochs), "--seed", str(seed),
               "--out-dir", str(run), "--overwrite", "--no-progress", *options]
        code = _run(cmd, log, args.timeout)
        row["train_s"] = round(time.time() - start, 1)
        if code != 0:
            return {**row, "status": f"train exit {code}"}
    row.update(train_summary(run))
    grid: dict[float, dict[float, float]] = {}  # prior scale -> acoustic scale -> dev WER
    for ps in (float(v) for v in args.prior_scales.split(",")):
        suffix = "" if ps == 1 else f".ps{ps:g}"  # exponent 1 keeps the files' old names
        ll = run / f"dev{suffix}.ll.h5"
        if _forward(run, args.build / "dev.h5", ll, ps, log, args) != 0:
            return {**row, "status": "forward dev failed"}
        grid[ps] = {}
        for scale in (float(v) for v in args.scales.split(",")):
            rec = _decode(ll, args.build, args.build / "dev.text", scale, args,
                          run / f"dev-{scale}{suffix}.wer.json", log)
            if rec is None:
                return {**row, "status": f"decode dev {scale} failed"}
            grid[ps][scale] = rec["score"]["wer"]
    # The pair with the lowest dev WER (never test's) decodes test, once.
    ps, best = min(((p, s) for p in grid for s in grid[p]), key=lambda k: grid[k[0]][k[1]])
    if _forward(run, test[0], run / "test.ll.h5", ps, log, args) != 0:
        return {**row, "status": "forward test failed"}
    rec = _decode(run / "test.ll.h5", args.build, test[1], best, args, run / "test.wer.json",
                  log)
    if rec is None:
        return {**row, "status": "decode test failed"}
    # The same utterances frame by frame (~60x the words): accuracy and how sure the model is.
    try:
        row["test_frames"] = frame_stats(run / "test.ll.h5", test[0], run / "priors.json", ps)
    except (OSError, KeyError, ValueError) as e:  # a diagnostic: the WER row stands without
        row["test_frames"] = {"error": str(e)}
    dev: dict[Any, Any] = grid[ps]
    if len(grid) > 1:
        row["prior_scale"], row["dev_grid"] = ps, {str(p): grid[p] for p in grid}
    score = rec["score"]
    return {**row, "status": "ok", "dev_wer": dev, "scale": best, "wer": score["wer"],
            "ref_words": score["ref_words"], "sentences": score["sentences"],
            "test_every": args.test_every, "beam": args.beam, "max_active": args.max_active,
            "cell_s": round(time.time() - start, 1)}


def load_rows(runs: Path, name: str = "results.jsonl") -> list[dict[str, Any]]:
    """The last row of every cell in ``runs/name``."""
    path = runs / name
    if not path.exists():
        return []
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["config"], r["workers"], r["seed"])] = r
    return list(rows.values())


DIVERGED = "train exit 4"
"""A cell whose run stopped itself on a diverged or non-finite loss (hadpsgd's exit 4)."""


def report(rows: list[dict[str, Any]]) -> str:
    """The markdown table: WER by seed, mean ± standard error, paired against SSGD."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ssgd = {(r["workers"], r["seed"]): r["wer"] for r in ok if r["config"] == "ssgd"}
    out = ["| configuration | workers | test WER by seed | mean ± s.e. | vs SSGD (paired, "
           "mean ± s.e.) | held-out loss by epoch (seed 0) | MiB between nodes a rank | "
           "frames/s | test frames: accuracy %, posterior entropy (mean) |",
           "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:  # finished cells and diverged ones (exit 4: the run stopped itself)
        if r.get("status") in ("ok", DIVERGED):
            groups.setdefault((r["config"], r["workers"]), []).append(r)
    order = list(CONFIGS)
    for (config, workers), every in sorted(groups.items(),
                                           key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        every.sort(key=lambda r: r["seed"])
        rs = [r for r in every if r["status"] == "ok"]
        if not rs:
            out.append(f"| {config} | {workers} | {' / '.join('diverged' for _ in every)} | "
                       "— | — | — | — | — | — |")
            continue
        wers = [r["wer"] for r in rs]
        diffs = [r["wer"] - ssgd[(workers, r["seed"])] for r in rs
                 if (workers, r["seed"]) in ssgd]
        loss = " / ".join(f"{x:.3f}" for x in rs[0]["heldout_loss"])
        mib = statistics.mean(r["internode_bytes"] for r in rs) / 2**20
        fps = statistics.mean(r["frames_per_s"] or 0 for r in rs)
        vs = "—" if config == "ssgd" or not diffs else f"{_mean_se(diffs, signed=True)}"
        by_seed = " / ".join(f"{r['wer']:.1f}" if r["status"] == "ok" else "diverged"
                             for r in every)
        out.append(f"| {config} | {workers} | {by_seed} | "
                   f"{_mean_se(wers)} | {vs} | {loss} | {mib:,.1f} | {fps:,.0f} | "
                   f"{_frames(rs)} |")
    return "\n".join(out)


def _frames(rows: list[dict[str, Any]]) -> str:
    """Mean test frame accuracy and posterior entropy of the rows that scored their frames."""
    scored = [r["test_frames"] for r in rows if "frame_acc" in r.get("test_frames", {})]
    if not scored:
        return "—"
    acc = statistics.mean(f["frame_acc"] for f in scored) * 100
    ent = statistics.mean(f["posterior_entropy"] for f in scored)
    return f"{acc:.2f}, {ent:.3f} nats"


def _mean_se(xs: list[float], signed: bool = False) -> str:
    """``mean ± standard error`` (no error with one value)."""
    m = statistics.mean(xs)
    head = f"{m:+.2f}" if signed else f"{m:.2f}"
    if len(xs) < 2:
        return head + " (1 seed)"
    return f"{head} ± {statistics.stdev(xs) / len(xs) ** 0.5:.2f}"


def _claim(path: Path) -> bool:
    """Take a cell for this driver; False while a live driver holds it.

    Drivers may share RUNS (e.g. one per worker count) and must not train into one directory.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(path.read_text() or 0), 0)
            return False  # its driver is alive
        except (ProcessLookupError, ValueError):
            path.unlink(missing_ok=True)  # a dead driver's claim
            return _claim(path)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _bad_grid(values: str, flag: str) -> str:
    """Why ``values`` is not a comma-separated list of finite numbers in range ('' if it is).

    Prior exponents may be 0 (the posteriors themselves); acoustic scales must be above 0.
    """
    priors = flag == "--prior-scales"
    try:
        numbers = [float(v) for v in values.split(",")]
    except ValueError:
        numbers = []
    if not numbers or not all(math.isfinite(v) and (v >= 0 if priors else v > 0)
                              for v in numbers):
        return (f"{flag} {values}: give comma-separated numbers {'>= 0' if priors else '> 0'},"
                f" e.g. {flag} {'0.5,0.75,1' if priors else '0.15,0.2,0.25'}")
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run the cells not yet done, or print the report."""
    args = build_parser().parse_args(argv)
    if args.report:
        print(report(load_rows(args.runs, args.results)))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"{PROG}: unknown configuration(s) {', '.join(unknown)}: choose from "
              f"{', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    bad = _bad_grid(args.prior_scales, "--prior-scales") or _bad_grid(args.scales, "--scales")
    if bad:  # before any training: the forward or the decoder would refuse it after it
        print(f"{PROG}: {bad}", file=sys.stderr)
        return 2
    missing = [n for n in ("train.h5", "dev.h5", "test.h5", "test.text", "dev.text",
                           "HCLG.fst", "words.txt") if not (args.build / n).exists()]
    if missing:
        print(f"{PROG}: {args.build} lacks {', '.join(missing)}: run "
              "examples/speechocean/build.py first", file=sys.stderr)
        return 2
    args.runs.mkdir(parents=True, exist_ok=True)
    test = test_subset(args.build, args.test_every)
    for workers in (int(w) for w in args.workers.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for config in configs:
                # Read again before every cell: another driver may have run it meanwhile.
                done = {(r["config"], r["workers"], r["seed"])
                        for r in load_rows(args.runs, args.results) if r.get("status") == "ok"}
                if (config, workers, seed) in done:
                    continue
                claim = args.runs / f"{config}-w{workers}-s{seed}.claim"
                if not _claim(claim):
                    continue
                try:
                    row = run_cell(config, workers, seed, args, test)
                    with (args.runs / args.results).open("a") as f:
                        f.write(json.dumps(row) + "\n")
                finally:
                    claim.unlink(missing_ok=True)
                print(f"{config} w{workers} s{seed}: {row['status']}"
                      + (f", test WER {row['wer']:.2f} at scale {row['scale']}"
                         if row["status"] == "ok" else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
