"""``--wire signtopk`` (issue 57) against a reference written from its definition.

The definition: per chunk of 4,096 consecutive values (the row, if shorter) the
``round(112 * chunk / 4096)`` of largest magnitude are chosen; each decodes to
``sign(value) * scale``, every other value to 0, where ``scale`` is the mean magnitude of its
chunk's chosen values; a chosen value costs its sign bit and its place's Elias-Fano code,
``2 + floor(log2(chunk / k))`` bits, a chunk 4 bytes more. The reference below computes the
values with plain Python loops, not with the codec's tensor operations.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from hadpsgd.comm import decode, encode, payload_bytes
from hadpsgd.comm.codec import decode_rows, encode_rows, parse_wire, wire_spec
from hadpsgd.comm.sparse import pack_bits, unpack_bits
from hadpsgd.config import parse_config


def _reference(x: list[float]) -> list[float]:
    """The decoded values by the definition, value by value."""
    m = len(x)
    chunk = min(4096, m)
    k = max(1, round(112 * chunk / 4096))
    out = [0.0] * m
    for lo in range(0, m, chunk):
        idx = sorted(range(lo, min(lo + chunk, m)), key=lambda i: -abs(x[i]))[:k]
        scale = sum(abs(x[i]) for i in idx) / len(idx)
        for i in idx:
            out[i] = scale if x[i] >= 0 else -scale
    return out


@pytest.mark.parametrize("m", [1, 2, 3, 63, 64, 130, 4095, 4096, 4096 + 200, 3 * 4096])
def test_decoded_values_are_the_definitions(m: int) -> None:
    rng = random.Random(m)
    x = [rng.gauss(0.0, 1.0) * (10.0 if rng.random() < 0.05 else 1.0) for _ in range(m)]
    y = decode(encode(torch.tensor(x), "signtopk"), m, "signtopk", torch.float64)
    ref = _reference(x)
    assert max(abs(a - b) for a, b in zip(y.tolist(), ref, strict=True)) < 1e-5 * max(
        1.0, max(abs(v) for v in ref))


def test_bytes_are_eight_bits_a_chosen_value_and_a_scale_a_chunk() -> None:
    # 112 of 4,096: low bits floor(log2(4096 / 112)) = 5, a high vector of 112 + 4095 >> 5
    # = 239 bits, 112 signs: 560 + 239 + 112 bits and a 4-byte scale, 118 bytes a chunk
    for chunks in (1, 2, 199):
        assert payload_bytes(4096 * chunks, "signtopk") == 4 * chunks + math.ceil(
            chunks * 560 / 8) + math.ceil(chunks * 239 / 8) + math.ceil(chunks * 112 / 8)
    assert payload_bytes(4096, "signtopk") == 118
    # ~139x below fp32 a sync on a large tensor: 1,111x a step at a block of 8
    assert 4 * 4096 * 200 / payload_bytes(4096 * 200, "signtopk") == pytest.approx(138.9, rel=0.01)


def test_rows_code_alone_and_every_node_encodes_the_same_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5000, generator=g)
    x[1, 100:164] = 0.5  # a group of ties: the same choice on every call
    rows = encode_rows(x, "signtopk")
    assert torch.equal(rows, encode_rows(x.clone(), "signtopk"))
    for r in range(3):
        assert torch.equal(rows[r], encode(x[r], "signtopk"))
    y = decode_rows(rows, 5000, "signtopk", torch.float32)
    assert y.shape == (3, 5000) and int((y != 0).sum()) == 3 * 2 * 112


def test_the_scale_is_the_least_squares_magnitude_of_the_chosen() -> None:
    # For fixed signs on the chosen values, sum (|x_i| - s)^2 is least at s = mean |x_i|:
    # a larger or smaller scale leaves a larger error on them.
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    y = decode(encode(x, "signtopk"), 4096, "signtopk", torch.float32)
    on = y != 0
    err = float((x[on] - y[on]).pow(2).sum())
    for k in (0.9, 1.1):
        assert err < float((x[on] - k * y[on]).pow(2).sum())


@pytest.mark.parametrize("bits", [1, 3, 6, 7, 12])
def test_bit_packing_round_trips(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 9, 100):
        codes = torch.randint(0, 1 << bits, (2, n), generator=g)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.shape == (2, math.ceil(n * bits / 8))
        assert torch.equal(unpack_bits(packed, bits, n), codes)
    # the first code in the lowest bits of the first byte
    assert pack_bits(torch.tensor([[1, 0, 0]]), 3).tolist() == [[1, 0]]
    assert pack_bits(torch.tensor([[0, 0, 1]]), 3).tolist() == [[64, 0]]


def test_the_fraction_is_the_wires_own_by_default_and_the_users_when_given() -> None:
    assert parse_wire("signtopk").fraction == 112 / 4096
    assert wire_spec("signtopk") == "signtopk:0.02734375"
    assert wire_spec("signtopk", 48 / 4096) == "signtopk:0.01171875"
    assert wire_spec("topk") == "topk:0.015625" and wire_spec("sign") == "sign"
    # 48 of 4,096: low bits floor(log2(4096 / 48)) = 6, a high vector of 48 + 63 bits
    assert payload_bytes(4096, "signtopk:0.01171875") == 4 + 36 + 14 + 6
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5))
    y = decode(encode(x, "signtopk:0.01171875"), 4096, "signtopk:0.01171875", torch.float32)
    assert int((y != 0).sum()) == 48
    with pytest.raises(ValueError, match="signtopk fraction must be in"):
        parse_wire("signtopk:0")
    with pytest.raises(ValueError, match="signtopk:FRACTION"):
        parse_wire("sign:0.5")
    for wire, default in (("topk", 0.015625), ("signtopk", 0.02734375)):
        opts = parse_config(["--algo", "bmuf", "--wire", wire]).algo_options()
        assert opts.topk_fraction is None and opts.wire_spec == f"{wire}:{default}"
    opts = parse_config(["--algo", "bmuf", "--wire", "signtopk", "--topk-fraction",
                         "0.01171875"]).algo_options()
    assert opts.wire_spec == "signtopk:0.01171875"
