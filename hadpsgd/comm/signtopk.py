"""The ``signtopk`` wire format: the signs of a chunk's largest values, their places packed.

``topk`` (:mod:`hadpsgd.comm.sparse`) sends each chosen value as a 12-bit index and a 2-bit
value, 14 bits; at the ~1/32 of the values a block sync of 8 steps needs to keep BMUF's
workers at SSGD's WER (issue 57: 1/64 trailed on FSDD, 1/32 met it) that is 0.44 bit a
value, 585x below fp32 a step. ``signtopk`` sends about that share for half the bits: per
chunk of :data:`SIGNTOPK_CHUNK` values the ``k`` of largest magnitude (a fraction of the
chunk, by default :data:`SIGNTOPK_FRACTION`, 7 in 256), each as its sign, with one fp32
``scale = mean |chosen|`` a chunk (1-bit SGD's code, Seide et al. 2014, on top-k's
choice, as Sparse Binary Compression, Sattler et al. 2019, binarises its top-k), and the
chosen places as an **Elias-Fano code** of the sorted indices: each index's low
``L = floor(log2(chunk / k))`` bits as they are, its high bits in unary as one bit set at
``(index >> L) + i`` in a vector of ``k + chunk >> L`` bits.
That is ``2 + L`` bits a place (7 at 112 of 4,096, where the entropy of the choice is
6.5), 8 with the sign: ~0.23 bit a value, 139x below fp32 a sync and 1,111x a step at
BMUF's block of 8. Elias-Fano's size depends only on ``k`` and the chunk, so every row's
payload has a fixed length (the callers' contract for every wire), and both ways are
tensor operations (a scatter, a ``nonzero``), on any device.

Choosing in small groups instead (two of each 64, a 6-bit index) was tried and lost: a sign
code gives every chosen value its chunk's one magnitude, and a group's forced choice mixes
small values with large ones under it (FSDD fold A, 3 seeds: 10.5 % WER against 8.0 for
the same share chosen per 4,096; docs/results.md).

What is not chosen stays with the sender (the error-feedback residual, or with
``--bmuf-residual model`` the worker's own model) and is sent once it has grown into its
chunk's top ``k``. Non-finite input is always chosen and spoils its chunk's scale, so its
chunk's chosen values decode non-finite and the trainer's finiteness checks still see them.

A row is ``[scales (fp32) | low bits | high bit vectors | sign bits]``, each part packed
lowest bit first (:func:`hadpsgd.comm.sparse.pack_bits`).
"""

from __future__ import annotations

import torch

from hadpsgd.comm.sparse import pack_bits, reinterpret, unpack_bits

SIGNTOPK_CHUNK = 4096
"""Values per chunk: one scale, one choice, one Elias-Fano code."""
SIGNTOPK_FRACTION = 112 / 4096
"""The default share chosen, 112 of each 4,096 (7 in 256, ~1/37): at 8 bits a chosen value
a block sync of 8 steps is ~1,100x fewer bytes than SSGD fp32 a step (1/32 would be 992x).
``--topk-fraction`` sets another; BMUF's default scales it to its block, keeping these bytes
a step (46 of 4,096 at a block of 4: ``hadpsgd.algorithms.bmuf.options.default_share``)."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def signtopk_shape(m: int, fraction: float) -> tuple[int, int, int, int, int]:
    """``(chunk, chunks, k, low_bits, high_bits)`` of a row of ``m`` > 0 values."""
    chunk = min(SIGNTOPK_CHUNK, m)
    k = max(1, min(chunk, round(fraction * chunk)))
    low = (chunk // k).bit_length() - 1  # floor(log2(chunk / k))
    return chunk, _ceil(m, chunk), k, low, k + ((chunk - 1) >> low)


def _parts(m: int, fraction: float) -> tuple[int, int, int, int]:
    """Byte lengths of a row's scales, low bits, high bit vectors and signs."""
    _, chunks, k, low, high = signtopk_shape(m, fraction)
    return 4 * chunks, _ceil(chunks * k * low, 8), _ceil(chunks * high, 8), _ceil(chunks * k, 8)


def signtopk_bytes(m: int, fraction: float = SIGNTOPK_FRACTION) -> int:
    """Bytes of a ``signtopk`` row of ``m`` values."""
    return 0 if m == 0 else sum(_parts(m, fraction))


def encode_signtopk_rows(x: torch.Tensor, fraction: float = SIGNTOPK_FRACTION) -> torch.Tensor:
    """``[R, m]`` floats -> ``[R, signtopk_bytes(m, fraction)]`` bytes (the module docstring)."""
    rows, m = x.shape
    if m == 0:
        return torch.empty(rows, 0, dtype=torch.uint8, device=x.device)
    chunk, chunks, k, low, high = signtopk_shape(m, fraction)
    blocks = torch.nn.functional.pad(x.to(torch.float32), (0, chunks * chunk - m))
    blocks = blocks.view(rows, chunks, chunk)
    # sorted=True: the same choice on every rank and device, ties too, so a node's learners
    # encode the same bytes; then in the order of place, which Elias-Fano needs.
    place = blocks.abs().topk(k, dim=2, sorted=True).indices.sort(dim=2).values
    values = blocks.gather(2, place)
    # The L2-closest one magnitude for the chosen: their mean, over the chunk's own values
    # (a short last chunk chooses padding too, whose zeros must not shrink it).
    counts = torch.full((chunks,), float(k), device=x.device)
    counts[-1] = float(min(k, m - (chunks - 1) * chunk))
    scale = values.abs().sum(dim=2).div_(counts)
    vector = torch.zeros(rows, chunks, high, dtype=torch.int64, device=x.device)
    vector.scatter_(2, (place >> low) + torch.arange(k, device=x.device), 1)
    parts = [scale.contiguous().view(torch.uint8).view(rows, -1),
             pack_bits((place & ((1 << low) - 1)).view(rows, -1), low),
             pack_bits(vector.view(rows, -1), 1),
             pack_bits((values >= 0).view(rows, -1), 1)]
    return torch.cat(parts, dim=1)


def decode_signtopk_rows(p: torch.Tensor, m: int, dtype: torch.dtype,
                         fraction: float = SIGNTOPK_FRACTION) -> torch.Tensor:
    """Inverse of :func:`encode_signtopk_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype``."""
    rows = p.shape[0]
    if m == 0:
        return torch.zeros(rows, 0, dtype=dtype, device=p.device)
    chunk, chunks, k, low, high = signtopk_shape(m, fraction)
    a, b, c, _ = _parts(m, fraction)
    scale = reinterpret(p[:, :a], torch.float32)
    lows = unpack_bits(p[:, a:a + b], low, chunks * k).view(rows, chunks, k)
    vector = unpack_bits(p[:, a + b:a + b + c], 1, chunks * high).view(rows * chunks, high)
    # Each chunk's vector has exactly k bits set, in order: the i-th set bit, at
    # (index >> low) + i, gives the i-th index's high bits.
    at = vector.nonzero()[:, 1].view(rows, chunks, k)
    place = ((at - torch.arange(k, device=p.device)) << low) | lows
    sign = unpack_bits(p[:, a + b + c:], 1, chunks * k).view(rows, chunks, k)
    values = sign.to(torch.float32).mul_(2.0).sub_(1.0).mul_(scale.unsqueeze(2))
    out = torch.zeros(rows, chunks, chunk, dtype=torch.float32, device=p.device)
    out.scatter_(2, place, values)
    # The last chunk's padding may have been chosen (fewer than k values left): cut off.
    return out.view(rows, -1)[:, :m].to(dtype)


__all__ = ["SIGNTOPK_CHUNK", "SIGNTOPK_FRACTION", "decode_signtopk_rows", "encode_signtopk_rows",
           "signtopk_bytes", "signtopk_shape"]
