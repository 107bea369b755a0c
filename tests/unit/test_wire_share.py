"""A wire's share (``sign@0.25``): each exchange sends a rotating part of the tensor.

The references are written here from what a share promises, not from the code: a round
sends only its chunks of :data:`~hadpsgd.comm.compressed.SHARE_CHUNK` columns of every
shard, every column once in ``1 / share`` rounds, and error feedback keeps what a round
left out, so constant inputs come out, over those rounds, as the mean times the rounds
(up to the format's rounding). Run on the in-process world (learners as threads), where
the MPI world's ``SideChannel`` and ``CompressedMean`` run unchanged.
"""

from __future__ import annotations

import pytest
import torch

from hadpsgd.comm import World
from hadpsgd.comm.codec import parse_wire, payload_bytes, wire_spec
from hadpsgd.comm.compressed import SHARE_CHUNK
from hadpsgd.comm.threads import ThreadJob

NODES = 2
NUMEL = NODES * 4 * SHARE_CHUNK  # a shard per node of 4 chunks


def node_tensor(node: int) -> torch.Tensor:
    """A tensor the same on every learner of ``node``, different between nodes (positive:
    no value's mean rounds to 0, so "sent" is "not 0")."""
    g = torch.Generator().manual_seed(100 + node)
    return torch.rand(NUMEL, generator=g) + 0.5


def test_a_spec_names_its_share_and_only_residual_keeping_formats_take_one() -> None:
    assert parse_wire("sign@0.25").share == 0.25
    assert parse_wire("sign").share == 1.0
    assert wire_spec("int4", share=0.5) == "int4@0.5"
    assert wire_spec("sign") == "sign"
    for bad, says in (("fp32@0.5", "only bf16"), ("topk@0.5", "only bf16"),
                      ("sign@0", "(0, 1]"), ("sign@1.5", "(0, 1]"), ("sign@x", "(0, 1]")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            parse_wire(bad)


def rounds_of(wire: str, rounds: int, save_after: int | None = None, per_node: int = 2
              ) -> list[list[torch.Tensor]]:
    """Each learner's outputs of ``rounds`` means of its node's constant tensor.

    With ``save_after``, the side channel is closed after that many rounds and a new one
    takes its state (a resume), then goes on. With ``per_node`` learners a node, each
    carries a slice of the node's tensor (``NODES * per_node`` shards in all).
    """
    def learner(w: World) -> list[torch.Tensor]:
        x = node_tensor(w.node)
        side, out = w.side_channel(wire, background=False), []
        for r in range(rounds):
            if r == save_after:
                state = side.state_dict()
                side.close()
                side = w.side_channel(wire, background=False)
                side.load_state_dict(state, {"x": x})
            t = x.clone()
            side.mean_("x", t)
            out.append(t)
        side.close()
        return out

    return ThreadJob(per_node * NODES, per_node, timeout=60).run(learner)


def mean_of_nodes() -> torch.Tensor:
    return sum(node_tensor(k) for k in range(NODES)) / NODES


@pytest.mark.parametrize(("per_node", "share"), [(1, 0.25), (2, 0.5)])
def test_a_round_sends_its_chunks_and_every_column_is_sent_once_in_one_over_share(
        per_node: int, share: float) -> None:
    rounds = round(1 / share)
    every = rounds_of(f"bf16@{share}", rounds, per_node=per_node)
    first = every[0]
    assert all(torch.equal(a, b) for got in every for a, b in zip(got, first, strict=True))
    shard = NUMEL // (NODES * per_node)  # 4 chunks a row for one learner a node, 2 for two
    chunk_of = (torch.arange(NUMEL) % shard) // SHARE_CHUNK  # chunk of its shard's row
    sent = torch.zeros(NUMEL, dtype=torch.long)
    for r, t in enumerate(first):
        # Round r sends chunk r of each shard (one a round), nothing else.
        assert torch.count_nonzero(t[chunk_of != r]) == 0
        assert torch.count_nonzero(t[chunk_of == r]) == (chunk_of == r).sum()
        sent += (t != 0).long()
    assert torch.equal(sent, torch.ones_like(sent))


def delivered(share: float, rounds: int, chunks: int = 4) -> torch.Tensor:
    """Rounds of input each chunk of a row has delivered after ``rounds`` rounds, from the
    promise: round r sends the next ``chunks * share`` chunks, wrapping, and a chunk sent
    brings every round's input since it was last sent (error feedback)."""
    per_round = round(chunks * share)
    last = [-1] * chunks
    for r in range(rounds):
        for i in range(per_round):
            last[(r * per_round + i) % chunks] = r
    return torch.tensor([x + 1 for x in last], dtype=torch.float32)


def error_after(wire: str, rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|outputs' total - the delivered rounds' means| and the latter, per value."""
    total = sum(rounds_of(wire, rounds, per_node=1)[0])
    shard = NUMEL // NODES
    chunk_of = (torch.arange(NUMEL) % shard) // SHARE_CHUNK
    want = delivered(parse_wire(wire).share, rounds)[chunk_of] * mean_of_nodes()
    return (total - want).abs(), want.abs()


@pytest.mark.parametrize(("wire", "tolerance"), [("bf16@0.5", 0.01), ("int8@0.25", 0.02)])
def test_error_feedback_keeps_what_a_round_left_out(wire: str, tolerance: float) -> None:
    """Constant inputs: each column's outputs total its mean times the rounds its chunk has
    delivered (up to the format's rounding, which the residuals carry on)."""
    err, want = error_after(wire, 9)
    assert err.max() < tolerance * want.max()


def test_one_bit_a_value_with_a_share_converges_to_the_mean() -> None:
    """sign's rounding is coarse, but error feedback carries it: the outputs' error stays
    bounded while the total grows, so their relative error falls with the rounds."""
    (err9, want9), (err33, want33) = error_after("sign@0.5", 9), error_after("sign@0.5", 33)
    relative9, relative33 = err9.mean() / want9.mean(), err33.mean() / want33.mean()
    assert relative33 < 0.1 and relative33 < relative9 / 2


def test_a_resume_goes_on_with_the_next_share_and_the_same_residuals() -> None:
    whole = rounds_of("int4@0.5", 5)[0]
    resumed = rounds_of("int4@0.5", 5, save_after=3)[0]
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


def test_a_round_costs_its_share_of_the_bytes() -> None:
    def learner(w: World) -> int:
        side = w.side_channel("sign@0.25", background=False)
        t = node_tensor(w.node)
        side.mean_("x", t)
        sent = side.bytes_sent
        side.close()
        return sent

    sent = ThreadJob(NODES, 1, timeout=60).run(learner)[0]
    shard = NUMEL // NODES
    # Two stages, each sending N - 1 of N shards of the round's share: one chunk of four.
    assert sent == 2 * (NODES - 1) * payload_bytes(shard // 4, "sign")


def test_bmuf_takes_a_share_only_on_a_wire_that_keeps_a_residual() -> None:
    from hadpsgd.algorithms.bmuf.options import BMUFOptions
    from hadpsgd.cli import ConfigError

    assert BMUFOptions(wire="sign", wire_share=0.25).wire_spec == "sign@0.25"
    assert BMUFOptions(wire="int4").wire_spec == "int4"
    with pytest.raises(ConfigError, match="--wire-share 0.5 needs a wire .* not --wire fp32"):
        BMUFOptions(wire_share=0.5)
    with pytest.raises(ConfigError, match="--wire-share 0.5 needs .* not --wire topk"):
        BMUFOptions(wire="topk", wire_share=0.5)
    with pytest.raises(ConfigError, match=r"--wire-share must be in \(0, 1\]"):
        BMUFOptions(wire="sign", wire_share=0.0)
