"""The sub-byte wire formats (``int4``, ``sign``, ``topk``) against NumPy references of their
definitions.

The references are written from the formats' definitions (``hadpsgd.comm.sparse``'s
docstring), not from the code: int4 rounds ``x / scale`` to the nearest integer with
``scale = absmax / 7`` per chunk of 1024 values; sign sends ``+-scale`` by the value's sign
(zero: plus) with ``scale`` the mean magnitude per chunk of 4096 values; top-k keeps per
chunk of 4096 values (the row's length if shorter) the ``k = round(fraction * chunk)``
values of largest magnitude, each as the nearest of ``(-1.5, -0.5, 0.5, 1.5) * scale``
with ``scale = absmax / 1.5`` of the kept values, and zero elsewhere.
"""

import math

import numpy as np
import pytest
import torch

from hadpsgd.algorithms import BMUFOptions
from hadpsgd.cli import ConfigError
from hadpsgd.comm.codec import decode, decode_rows, encode, encode_rows, parse_wire, payload_bytes
from hadpsgd.comm.codec import wire_spec as spec_of
from hadpsgd.comm.sparse import INT4_CHUNK, SIGN_CHUNK, TOPK_CHUNK, TOPK_FRACTION

SIZES = [1, 7, 1000, INT4_CHUNK + 1, TOPK_CHUNK - 1, TOPK_CHUNK, TOPK_CHUNK + 1,
         3 * TOPK_CHUNK + 517]


def _data(n: int, seed: int = 0) -> np.ndarray:
    """Values whose magnitude differs by orders from one 1024-value stretch to the next."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-3, 3, n // 1024 + 1).repeat(1024)[:n]
    return (rng.standard_normal(n) * scale).astype(np.float32)


def _int4_reference(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    for lo in range(0, x.size, 1024):
        c = x[lo:lo + 1024]
        scale = np.float32(np.abs(c).max()) / np.float32(7.0)
        if scale > 0:
            out[lo:lo + 1024] = np.clip(np.rint(c / scale), -7, 7) * scale
    return out


def _sign_reference(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    for lo in range(0, x.size, 4096):
        c = x[lo:lo + 4096]
        scale = np.abs(c.astype(np.float64)).mean()
        out[lo:lo + 4096] = np.where(c >= 0, scale, -scale)
    return out


def _topk_reference(x: np.ndarray, fraction: float) -> np.ndarray:
    chunk = min(4096, x.size)
    k = max(1, min(chunk, round(fraction * chunk)))
    out = np.zeros_like(x)
    for lo in range(0, x.size, chunk):
        c = x[lo:lo + chunk]
        keep = np.argsort(-np.abs(c), kind="stable")[:min(k, c.size)]
        scale = np.float32(np.abs(c[keep]).max()) / np.float32(1.5)
        levels = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32) * scale
        nearest = np.abs(c[keep][:, None] - levels[None, :]).argmin(axis=1)
        out[lo + keep] = levels[nearest]
    return out


@pytest.mark.parametrize("n", SIZES)
def test_int4_matches_its_definition(n):
    x = _data(n, seed=n)
    p = encode(torch.from_numpy(x), "int4")
    assert p.numel() == payload_bytes(n, "int4") == 4 * math.ceil(n / 1024) + math.ceil(n / 2)
    y = decode(p, n, "int4", torch.float32).numpy()
    np.testing.assert_allclose(y, _int4_reference(x), rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", SIZES)
def test_sign_matches_its_definition(n):
    x = _data(n, seed=n + 2)
    x[::97] = 0.0  # zero is coded as +scale
    p = encode(torch.from_numpy(x), "sign")
    assert p.numel() == payload_bytes(n, "sign") == 4 * math.ceil(n / SIGN_CHUNK) + math.ceil(n / 8)
    y = decode(p, n, "sign", torch.float32).numpy()
    np.testing.assert_allclose(y, _sign_reference(x), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fraction", [TOPK_FRACTION, 0.003, 0.1, 1.0])
@pytest.mark.parametrize("n", SIZES)
def test_topk_matches_its_definition(n, fraction):
    x = _data(n, seed=n + 1)
    spec = spec_of("topk", fraction)
    y = decode(encode(torch.from_numpy(x), spec), n, spec, torch.float32).numpy()
    np.testing.assert_allclose(y, _topk_reference(x, fraction), rtol=1e-6, atol=0)
    # Signs survive; as many nonzeros as chosen (a row shorter than a chunk: one chunk).
    kept = y != 0
    assert np.array_equal(np.sign(y[kept]), np.sign(x[kept]))


def test_topk_payload_size_and_ratio_to_fp32():
    # Per 4096-value chunk at 1/64: a 4-byte scale, 64 indices of 12 bits (96 bytes) and 64
    # values of 2 bits (16 bytes): 116 bytes against fp32's 16384, 141x fewer.
    assert payload_bytes(4096, "topk") == 4 + 96 + 16
    assert payload_bytes(4096, spec_of("topk", 1 / 64)) == 116
    n = 43_000_000  # about the SWB BLSTM
    assert payload_bytes(n, "fp32") / payload_bytes(n, "topk") > 140
    assert payload_bytes(n, "fp32") / payload_bytes(n, "int4") > 7.9
    assert 31.7 < payload_bytes(n, "fp32") / payload_bytes(n, "sign") < 32
    assert payload_bytes(n, "fp32") / payload_bytes(n, "int8") > 3.98
    # Fixed sizes: the bytes depend on the count, never on the values.
    for n in SIZES:
        for x in (torch.zeros(n), torch.from_numpy(_data(n)), torch.full((n,), math.nan)):
            for spec in ("int4", "sign", "topk", spec_of("topk", 0.2), "signtopk"):
                assert encode(x, spec).numel() == payload_bytes(n, spec)
    assert payload_bytes(0, "topk") == 0 and encode(torch.zeros(0), "topk").numel() == 0


def test_rows_are_coded_each_on_its_own():
    # CompressedMean sends row j to node j: each row's bytes are its own row's code.
    x = torch.from_numpy(_data(4 * 3000, seed=9)).view(4, 3000)
    for spec in ("int4", "sign", "topk", spec_of("topk", 0.05), "signtopk"):
        rows = encode_rows(x, spec)
        assert rows.shape == (4, payload_bytes(3000, spec))
        for j in range(4):
            assert torch.equal(rows[j], encode(x[j], spec))
        assert torch.equal(decode_rows(rows, 3000, spec, torch.float32)[2],
                           decode(rows[2], 3000, spec, torch.float32))


def test_non_finite_spoils_only_its_topk_chunk():
    x = torch.from_numpy(_data(3 * TOPK_CHUNK, seed=2))
    x[TOPK_CHUNK + 9] = math.inf
    y = decode(encode(x, "topk"), x.numel(), "topk", torch.float32)
    assert not math.isfinite(float(y[TOPK_CHUNK + 9]))
    others = torch.cat([y[:TOPK_CHUNK], y[2 * TOPK_CHUNK:]])
    assert bool(torch.isfinite(others).all())


def test_wire_specs_are_self_describing():
    assert spec_of("topk", 0.03) == "topk:0.03" and spec_of("int8", 0.03) == "int8"
    assert parse_wire("topk").fraction == TOPK_FRACTION
    assert parse_wire("topk:0.25").fraction == 0.25
    # A payload says its size through its spec: a different fraction, a different size.
    assert payload_bytes(10_000, "topk:0.25") > payload_bytes(10_000, "topk")
    for bad in ("topk:0", "topk:1.5", "topk:x", "topk:nan", "int8:0.1", "fp8"):
        with pytest.raises(ValueError, match="topk|wire must be one of"):
            parse_wire(bad)


def test_topk_fraction_option_names_the_flag_and_the_fix():
    assert BMUFOptions(wire="topk", topk_fraction=0.05).wire_spec == "topk:0.05"
    assert BMUFOptions(wire="int4").wire_spec == "int4"
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=r"--topk-fraction must be in \(0, 1\].*0\.015625"):
            BMUFOptions(wire="topk", topk_fraction=bad)
    with pytest.raises(ConfigError, match="--topk-fraction"):
        BMUFOptions(wire="topk", topk_fraction=math.nan)
