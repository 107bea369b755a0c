"""The sub-byte wire formats: ``int4``, ``sign`` and chunked ``topk``, row by row, fixed sizes.

Both code each row of a 2-D tensor on its own into a byte row whose length depends only on
the row's length (and the top-k fraction), so every caller that cuts a tensor into rows
(:class:`~hadpsgd.comm.compressed.CompressedMean`'s shards) or sends one payload (gossip)
works unchanged: MPI moves fixed-size byte messages, never a size negotiated at run time.

``int4``: per chunk of :data:`INT4_CHUNK` values one fp32 ``scale = absmax / 7`` and
``q = round(x / scale)`` in [-7, 7], two values a byte (~0.5 byte a value, 7.9x below fp32).

``sign`` (1-bit SGD's code, Seide et al., Interspeech 2014, for speech DNNs): per chunk of
:data:`SIGN_CHUNK` values one fp32 ``scale = mean |x|`` and one bit a value, ``+scale`` or
``-scale`` (~0.126 byte a value, 31.7x below fp32). Every value is sent every time, coarsely;
error feedback carries the rest.

``topk`` (SparseLoCo's shape): per chunk of :data:`TOPK_CHUNK` values (the row's length if
shorter) the ``k = round(fraction * chunk)`` entries of largest magnitude, each as a 12-bit
index in the chunk and a 2-bit value ``(q - 1.5) * scale``, ``q`` in 0..3, with one fp32
``scale = absmax / 1.5`` over the chunk's chosen values: the four levels are symmetric and
never zero, so the sign always survives; the rest of the chunk decodes to 0. A row is
``[scales (fp32) | indices (12-bit pairs in 3 bytes) | values (four 2-bit codes a byte)]``.
With error feedback what was not sent stays in the sender's residual and is sent once it
has grown into the chunk's top k.

Non-finite input spoils its chunk's scale, so its chunk decodes to non-finite values (the
trainer's finiteness checks still see it), and only its chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INT4_CHUNK = 1024
"""Values per int4 scale (as int8's: the scale's 4 bytes are 0.8 % of a chunk's payload)."""
SIGN_CHUNK = 4096
"""Values per sign scale (a scale is 0.8 % of a chunk's 512 bytes)."""
TOPK_CHUNK = 4096
"""Values per top-k chunk: an index in it fits the 12 bits :func:`_pack12` packs (at most
4,096; SparseLoCo's choice)."""
TOPK_FRACTION = 1 / 64
"""The default top-k fraction: 64 of every 4,096 values (SparseLoCo's 1.56 %)."""


def reinterpret(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes seen as ``dtype`` (a copy where they are not aligned to its size)."""
    if p.shape[-1] == 0:  # torch gives an empty row the stride 1, which no view accepts
        return torch.empty(p.shape, dtype=dtype, device=p.device)
    try:
        return p.view(dtype)
    except RuntimeError:  # a fresh tensor: clone() would keep a size-1 row's odd stride
        return torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(p).view(dtype)


def _chunks(m: int, chunk: int) -> int:
    return -(-m // chunk)


# ------------------------------------------------------------------ the scaled-chunk frame
# int8, int4 and sign rows share one frame: per chunk of values one fp32 scale, the row
# ``[scales | codes]``, a value decoded as its code times its chunk's scale.
def blocks_of(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[R, m]`` -> fp32 ``[R, chunks, chunk]``, the last chunk padded with zeros (a copy)."""
    rows, m = x.shape
    chunks = _chunks(m, chunk)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, chunks * chunk - m))
    return padded.view(rows, chunks, chunk)


def absmax_codes(x: torch.Tensor, chunk: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk ``scale = absmax / levels`` and ``q = round(x / scale)`` in [-levels, levels].

    Returns ``(scale [R, chunks], q [R, m])``, ``q`` as floats. ``amax`` propagates NaN and
    ``abs(-inf) = inf``: a non-finite chunk gets a non-finite scale, so it decodes to
    non-finite values and the trainer's finiteness checks still see it (its codes are 0).
    """
    rows, m = x.shape
    blocks = blocks_of(x, chunk)
    scale = blocks.abs().amax(dim=2).div_(float(levels))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero chunk: q = 0
    q = blocks.div_(safe.unsqueeze(2)).round_().clamp_(-levels, levels).nan_to_num_(0.0)
    return scale, q.view(rows, -1)[:, :m]


def framed(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """One byte row a row: ``[scales (fp32) | codes (uint8)]``."""
    rows, chunks = scale.shape
    out = torch.empty(rows, 4 * chunks + codes.shape[1], dtype=torch.uint8, device=codes.device)
    out[:, :4 * chunks] = scale.view(torch.uint8)
    out[:, 4 * chunks:] = codes
    return out


def unframed(p: torch.Tensor, m: int, chunk: int, dtype: torch.dtype,
             codes: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`framed`: each value ``codes(code bytes)`` times its chunk's scale.

    ``codes`` maps the rows' code bytes to ``[R, m]`` code values.
    """
    rows, chunks = p.shape[0], _chunks(m, chunk)
    scale = reinterpret(p[:, :4 * chunks], torch.float32)
    out = torch.zeros(rows, chunks * chunk, dtype=torch.float32, device=p.device)
    out[:, :m] = codes(p[:, 4 * chunks:])
    out.view(rows, chunks, chunk).mul_(scale.unsqueeze(2))
    return out[:, :m].to(dtype)


# ------------------------------------------------------------------ int4
def int4_bytes(m: int) -> int:
    """Bytes of an int4 row of ``m`` values: a 4-byte scale per chunk, two values a byte."""
    return 4 * _chunks(m, INT4_CHUNK) + _chunks(m, 2)


def encode_int4_rows(x: torch.Tensor) -> torch.Tensor:
    """``[R, m]`` floats -> ``[R, int4_bytes(m)]`` bytes (``[scales | nibbles]``)."""
    scale, q = absmax_codes(x, INT4_CHUNK, 7)
    return framed(scale, _pack((q + 8).to(torch.uint8), 4))  # 1..15: unsigned in a nibble


def decode_int4_rows(p: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_int4_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype``."""
    return unframed(p, m, INT4_CHUNK, dtype,
                    lambda b: _unpack(b, 4, m).to(torch.float32) - 8)


# ------------------------------------------------------------------ sign (1 bit)
def sign_bytes(m: int) -> int:
    """Bytes of a sign row of ``m`` values: a 4-byte scale per chunk, eight values a byte."""
    return 4 * _chunks(m, SIGN_CHUNK) + _chunks(m, 8)


def encode_sign_rows(x: torch.Tensor) -> torch.Tensor:
    """``[R, m]`` floats -> ``[R, sign_bytes(m)]`` bytes (``[scales | bits]``)."""
    rows, m = x.shape
    chunks = _chunks(m, SIGN_CHUNK)
    if m == 0:
        return torch.empty(rows, 0, dtype=torch.uint8, device=x.device)
    blocks = blocks_of(x, SIGN_CHUNK)
    # The mean magnitude over the chunk's own values (not the padding): the scale that makes
    # scale * sign(x) the closest code to x in the L2 sense. NaN / inf propagate into it.
    counts = torch.full((chunks,), float(SIGN_CHUNK), device=x.device)
    counts[-1] = m - (chunks - 1) * SIGN_CHUNK
    scale = blocks.abs().sum(dim=2).div_(counts)
    bits = (x >= 0).to(torch.uint8)  # 1: +scale, 0: -scale (zero goes up)
    return framed(scale, _pack(bits, 1))


def decode_sign_rows(p: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_sign_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype``."""
    return unframed(p, m, SIGN_CHUNK, dtype,
                    lambda b: _unpack(b, 1, m).to(torch.float32).mul_(2.0).sub_(1.0))


# ------------------------------------------------------------------ top-k
def topk_shape(m: int, fraction: float) -> tuple[int, int, int]:
    """``(chunk, chunks, k)`` of a top-k row of ``m`` values (``m`` > 0)."""
    chunk = min(TOPK_CHUNK, m)
    k = max(1, min(chunk, round(fraction * chunk)))
    return chunk, _chunks(m, chunk), k


def topk_bytes(m: int, fraction: float) -> int:
    """Bytes of a top-k row of ``m`` values: per chunk a scale, k indices and k values."""
    if m == 0:
        return 0
    _, chunks, k = topk_shape(m, fraction)
    n = chunks * k
    return 4 * chunks + 3 * _chunks(n, 2) + _chunks(n, 4)


def encode_topk_rows(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """``[R, m]`` floats -> ``[R, topk_bytes(m)]`` bytes (see the module docstring)."""
    rows, m = x.shape
    out = torch.empty(rows, topk_bytes(m, fraction), dtype=torch.uint8, device=x.device)
    if m == 0:
        return out
    chunk, chunks, k = topk_shape(m, fraction)
    blocks = torch.nn.functional.pad(x.to(torch.float32), (0, chunks * chunk - m))
    blocks = blocks.view(rows, chunks, chunk)
    # sorted=True: the same order on every rank and device (ties too), so a node's learners
    # encode the same bytes. NaN counts as the largest magnitude: it is always chosen.
    index = blocks.abs().topk(k, dim=2, sorted=True).indices
    values = blocks.gather(2, index)
    scale = values.abs().amax(dim=2).div_(1.5)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # The nearest of the levels -1.5, -0.5, 0.5, 1.5 (in scales): the sign, and whether the
    # magnitude reaches 1. Not floor(v + 2), which rounds a tiny negative v to +0.5.
    high = (values.abs().div_(safe.unsqueeze(2)) >= 1.0).to(torch.uint8)
    q = torch.where(values < 0, 1 - high, 2 + high)
    n = chunks * k
    out[:, :4 * chunks] = scale.view(torch.uint8)
    out[:, 4 * chunks:4 * chunks + 3 * _chunks(n, 2)] = _pack12(index.view(rows, n))
    out[:, 4 * chunks + 3 * _chunks(n, 2):] = _pack(q.view(rows, n), 2)
    return out


def decode_topk_rows(p: torch.Tensor, m: int, fraction: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_topk_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype``."""
    rows = p.shape[0]
    if m == 0:
        return torch.zeros(rows, 0, dtype=dtype, device=p.device)
    chunk, chunks, k = topk_shape(m, fraction)
    n, at = chunks * k, 4 * chunks
    scale = reinterpret(p[:, :at], torch.float32)
    index = _unpack12(p[:, at:at + 3 * _chunks(n, 2)], n).view(rows, chunks, k)
    q = _unpack(p[:, at + 3 * _chunks(n, 2):], 2, n).view(rows, chunks, k)
    values = (q.to(torch.float32) - 1.5).mul_(scale.unsqueeze(2))
    out = torch.zeros(rows, chunks, chunk, dtype=torch.float32, device=p.device)
    out.scatter_(2, index, values)
    # The last chunk's padding may have been chosen (fewer than k values left): cut off.
    return out.view(rows, -1)[:, :m].to(dtype)


# ------------------------------------------------------------------ bit packing
def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, n]`` codes below ``2**bits`` (1, 2 or 4) -> ``[R, ceil(n * bits / 8)]`` bytes."""
    rows, n = codes.shape
    per = 8 // bits
    padded = torch.nn.functional.pad(codes, (0, _chunks(n, per) * per - n))
    padded = padded.view(rows, -1, per)
    out = padded[:, :, 0].clone()
    for i in range(1, per):  # the first code in the low bits
        out |= padded[:, :, i] << (bits * i)
    return out


def _unpack(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``[R, B]`` bytes -> ``[R, n]`` codes (uint8)."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(p >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=2).view(p.shape[0], -1)[:, :n]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, n]`` integer codes below ``2**bits`` -> ``[R, ceil(n * bits / 8)]`` bytes.

    Any width: code ``i``'s bit ``b`` is bit ``i * bits + b`` of the row, the lowest bit of a
    byte first, the layout :func:`_pack` gives the widths that divide a byte (which take it).
    """
    rows, n = codes.shape
    if bits == 0:  # nothing to send (a chunk that sends all its values has no low bits)
        return torch.empty(rows, 0, dtype=torch.uint8, device=codes.device)
    if 8 % bits == 0:
        return _pack(codes.to(torch.uint8), bits)
    shifts = torch.arange(bits, device=codes.device)
    plane = ((codes.to(torch.int64).unsqueeze(2) >> shifts) & 1).view(rows, n * bits)
    plane = torch.nn.functional.pad(plane, (0, _chunks(n * bits, 8) * 8 - n * bits))
    return _pack(plane.to(torch.uint8), 1)


def unpack_bits(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[R, B]`` bytes -> ``[R, n]`` codes (int64)."""
    rows = p.shape[0]
    if bits == 0:
        return torch.zeros(rows, n, dtype=torch.int64, device=p.device)
    if 8 % bits == 0:
        return _unpack(p, bits, n).to(torch.int64)
    plane = _unpack(p, 1, n * bits).to(torch.int64).view(rows, n, bits)
    return (plane << torch.arange(bits, device=p.device)).sum(dim=2)


def _pack12(index: torch.Tensor) -> torch.Tensor:
    """``[R, n]`` indices below 4096 -> ``[R, 3 * ceil(n / 2)]`` bytes (a pair in 3 bytes)."""
    rows, n = index.shape
    i = torch.nn.functional.pad(index, (0, n % 2)).view(rows, -1, 2)
    a, b = i[:, :, 0], i[:, :, 1]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=2)
    return out.to(torch.uint8).view(rows, -1)


def _unpack12(p: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack12`: ``[R, 3 * ceil(n / 2)]`` bytes -> ``[R, n]`` int64."""
    rows = p.shape[0]
    t = p.to(torch.int64).view(rows, -1, 3)
    a = t[:, :, 0] | ((t[:, :, 1] & 0xF) << 8)
    b = (t[:, :, 1] >> 4) | (t[:, :, 2] << 4)
    return torch.stack([a, b], dim=2).view(rows, -1)[:, :n]


__all__ = ["INT4_CHUNK", "SIGN_CHUNK", "TOPK_CHUNK", "TOPK_FRACTION", "decode_int4_rows",
           "decode_sign_rows", "decode_topk_rows", "encode_int4_rows", "encode_sign_rows",
           "encode_topk_rows", "int4_bytes", "pack_bits", "reinterpret", "sign_bytes",
           "topk_bytes", "topk_shape", "unpack_bits"]
