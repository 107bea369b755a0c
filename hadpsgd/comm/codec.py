"""The wire formats of the inter-node exchanges: fp32, bf16, int8, int4, sign, topk, signtopk.

``--wire`` picks what BMUF's block sync and ADPSGD's gossip put on the inter-node link: the
tensor's own bytes (``fp32``, no compression), bfloat16 (2 bytes a value), int8 with one fp32
scale per :data:`INT8_CHUNK` values (~1 byte a value), the sub-byte formats of
:mod:`hadpsgd.comm.sparse`: ``int4`` (~0.5 byte a value), ``sign`` (1 bit a value) and
``topk`` (per chunk of 4,096 values its largest ``fraction``, 12-bit indices and 2-bit
values: ~141x below fp32 at the default 1/64), and :mod:`hadpsgd.comm.signtopk`'s
``signtopk`` (the signs of the largest 112 of 4,096, their places packed: ~139x). The
payload is a flat ``uint8`` tensor, so MPI moves it as bytes whatever the dtype, and its
size depends only on the number of values and the wire, never on the data.

A wire is named by a *spec*, a string that says all a decoder needs: a format of
:data:`WIRES`, with a sparse format's fraction after a colon (``topk:0.015625``;
:func:`wire_spec` writes one, :func:`parse_wire` reads it). Callers pass the spec where they
passed the format, and checkpoints record it, so a resume with another fraction is refused
by name.

A compressed format rounds; *error feedback* (1-bit Adam, PowerSGD) carries what one exchange
lost into the next: send ``encode(x + e)``, keep ``e = (x + e) - decode(that)``. Over K
exchanges the decoded values then sum to the inputs' sum minus the last residual, so nothing
is lost for good (for ``topk`` the residual holds what was not yet chosen). The callers keep
the residuals (:class:`~hadpsgd.comm.compressed.CompressedMean`, ADPSGD's gossip); this
module only codes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hadpsgd.comm.signtopk import (
    SIGNTOPK_FRACTION,
    decode_signtopk_rows,
    encode_signtopk_rows,
    signtopk_bytes,
)
from hadpsgd.comm.sparse import (
    TOPK_FRACTION,
    absmax_codes,
    decode_int4_rows,
    decode_sign_rows,
    decode_topk_rows,
    encode_int4_rows,
    encode_sign_rows,
    encode_topk_rows,
    framed,
    int4_bytes,
    reinterpret,
    sign_bytes,
    topk_bytes,
    unframed,
)

INT8_CHUNK = 1024
"""Values per int8 scale. A scale costs 4 bytes, so 1024 values carry 4/1024 = 0.4 % of
overhead (int8 stays at 3.98x below fp32), while a chunk is still small enough that one
large value only coarsens the rounding of its own 1023 neighbours, not of a whole layer."""


@dataclass(frozen=True)
class Wire:
    """A parsed wire spec: the format and, for ``topk``, the fraction of values sent."""

    name: str
    fraction: float = TOPK_FRACTION


def _int8_rows(x: torch.Tensor, w: Wire) -> torch.Tensor:
    scale, q = absmax_codes(x, INT8_CHUNK, 127)
    return framed(scale, q.to(torch.int8).view(torch.uint8))


@dataclass(frozen=True)
class WireFormat:
    """One wire format: what it is, what its exchanges do with it, and its codec.

    The one record of a format's facts: the codec below, ADPSGD's gossip (which formats it
    sends as CHOCO-SGD's differences) and BMUF's options (a coarse format's ``bits``) read
    them here, so a new wire touches this table, its codec and its tests. No format has a
    block length of its own: BMUF's recipe keeps fp32's for every wire (issue 57).
    """

    name: str
    bits: float
    """Bits on the wire a value, about (the format's overhead included; topk at its default
    fraction)."""
    sparse: bool
    """Sends some of the values (the rest waits in the residual), not a code of each."""
    differences: bool
    """ADPSGD sends it as CHOCO-SGD's compressed differences to per-edge estimates (a code
    this coarse of a whole model is useless); the others gossip the model itself."""
    feedback: bool
    """Rounds, so its callers keep the error-feedback residual."""
    payload: Callable[[int, Wire, int], int]
    """``(numel, wire, elem_size) -> bytes`` of a payload of ``numel`` values."""
    encode: Callable[[torch.Tensor, Wire], torch.Tensor]
    """``[R, m]`` values -> ``[R, P]`` bytes, each row on its own (may alias, fp32)."""
    decode: Callable[[torch.Tensor, int, Wire, torch.dtype], torch.Tensor]
    """``[R, P]`` bytes -> ``[R, m]`` values of the dtype (may alias, fp32)."""
    fraction: float | None = None
    """A sparse format's default share of the values sent (``--topk-fraction`` sets
    another); None for the formats that send every value."""


FORMATS: dict[str, WireFormat] = {f.name: f for f in (
    WireFormat("fp32", 32.0, sparse=False, differences=False, feedback=False,
               payload=lambda n, w, e: n * e,
               encode=lambda x, w: x.contiguous().view(torch.uint8),
               decode=lambda p, m, w, d: reinterpret(p, d)),
    WireFormat("bf16", 16.0, sparse=False, differences=False, feedback=True,
               payload=lambda n, w, e: 2 * n,
               encode=lambda x, w: x.to(torch.bfloat16).view(torch.uint8),
               decode=lambda p, m, w, d: reinterpret(p, torch.bfloat16).to(d)),
    WireFormat("int8", 8.03, sparse=False, differences=False, feedback=True,
               payload=lambda n, w, e: n + 4 * -(-n // INT8_CHUNK),
               encode=_int8_rows,
               decode=lambda p, m, w, d: unframed(p, m, INT8_CHUNK, d,
                                                  lambda b: reinterpret(b, torch.int8))),
    WireFormat("int4", 4.03, sparse=False, differences=False, feedback=True,
               payload=lambda n, w, e: int4_bytes(n),
               encode=lambda x, w: encode_int4_rows(x),
               decode=lambda p, m, w, d: decode_int4_rows(p, m, d)),
    WireFormat("sign", 1.01, sparse=False, differences=True, feedback=True,
               payload=lambda n, w, e: sign_bytes(n),
               encode=lambda x, w: encode_sign_rows(x),
               decode=lambda p, m, w, d: decode_sign_rows(p, m, d)),
    WireFormat("topk", 0.23, sparse=True, differences=True, feedback=True,
               payload=lambda n, w, e: topk_bytes(n, w.fraction),
               encode=lambda x, w: encode_topk_rows(x, w.fraction),
               decode=lambda p, m, w, d: decode_topk_rows(p, m, w.fraction, d),
               fraction=TOPK_FRACTION),
    WireFormat("signtopk", 0.23, sparse=True, differences=True, feedback=True,
               payload=lambda n, w, e: signtopk_bytes(n, w.fraction),
               encode=lambda x, w: encode_signtopk_rows(x, w.fraction),
               decode=lambda p, m, w, d: decode_signtopk_rows(p, m, d, w.fraction),
               fraction=SIGNTOPK_FRACTION),
)}
"""Every wire format by name, in the order ``--wire`` lists them."""
WIRES: tuple[str, ...] = tuple(FORMATS)
"""Wire formats; ``fp32`` is the tensor's own dtype, uncompressed."""
SPARSE_WIRES: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.sparse)
"""The formats that send a share of the values, each with its default fraction
(``--topk-fraction`` sets another)."""


def wire_spec(name: str, fraction: float | None = None) -> str:
    """The spec of format ``name``: ``<name>:<fraction>`` for a sparse one, else ``name``.

    A sparse format's own default fraction where ``fraction`` is None.
    """
    default = FORMATS[name].fraction if name in FORMATS else None
    spec = name if default is None else (
        f"{name}:{float(default if fraction is None else fraction)!r}")
    parse_wire(spec)  # refuses an unknown format or a fraction out of range
    return spec


@functools.lru_cache(maxsize=64)
def parse_wire(spec: str) -> Wire:
    """The :class:`Wire` a spec names (a sparse format alone: its default fraction).

    Raises:
        ValueError: For a format not in :data:`WIRES` or a fraction outside (0, 1].
    """
    name, _, rest = str(spec).partition(":")
    if name not in WIRES or (rest and FORMATS[name].fraction is None):
        raise ValueError(f"wire must be one of {', '.join(WIRES)} ("
                         f"{' or '.join(f'{w}:FRACTION' for w in SPARSE_WIRES)} for a "
                         f"fraction), got {spec!r}")
    if not rest:
        return Wire(name, FORMATS[name].fraction or TOPK_FRACTION)
    try:
        fraction = float(rest)
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction <= 1.0:  # NaN fails this too
        raise ValueError(f"the {name} fraction must be in (0, 1], got {rest!r} in {spec!r}")
    return Wire(name, fraction)


def check_wire(wire: str) -> None:
    """Raise ``ValueError`` unless ``wire`` is a spec of one of :data:`WIRES`."""
    parse_wire(wire)


def payload_bytes(numel: int, wire: str, elem_size: int = 4) -> int:
    """Bytes :func:`encode` makes of ``numel`` values (``elem_size``: the dtype's, for fp32)."""
    w = parse_wire(wire)
    return FORMATS[w.name].payload(numel, w, elem_size)


def encode_rows(x: torch.Tensor, wire: str) -> torch.Tensor:
    """Encode each row of the 2-D ``x`` on its own: ``[R, m]`` values -> ``[R, P]`` bytes.

    May return a view of ``x`` (fp32). int8 rows are ``[scales (fp32) | values (int8)]``;
    ``int4``, ``sign`` and ``topk`` rows are :mod:`hadpsgd.comm.sparse`'s. Each row has
    ``payload_bytes(m, wire)`` bytes, whatever its values.
    """
    w = parse_wire(wire)
    return FORMATS[w.name].encode(x, w)


def decode_rows(p: torch.Tensor, m: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype`` (may alias)."""
    w = parse_wire(wire)
    return FORMATS[w.name].decode(p, m, w, dtype)


def encode(x: torch.Tensor, wire: str) -> torch.Tensor:
    """A flat float tensor as a new flat ``uint8`` payload of :func:`payload_bytes` bytes.

    ``fp32``: the raw bytes of ``x`` (its own dtype); ``bf16``: ``x`` rounded to bfloat16;
    ``int8``: per chunk of :data:`INT8_CHUNK` values, ``scale = absmax / 127`` (fp32) and
    ``q = round(x / scale)`` (a zero chunk has scale 0; a non-finite one a non-finite scale);
    ``int4``, ``sign``, ``topk``: :mod:`hadpsgd.comm.sparse`. Computed on ``x``'s device.
    """
    out = encode_rows(x.reshape(1, -1), wire).reshape(-1)
    return out.clone() if parse_wire(wire).name == "fp32" else out


def decode(payload: torch.Tensor, numel: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``numel`` values of ``dtype`` an :func:`encode` payload stands for (a new tensor)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    if payload.numel() != payload_bytes(numel, wire, elem):
        raise ValueError(f"a {wire} payload of {numel} {dtype} values has "
                         f"{payload_bytes(numel, wire, elem)} bytes, got {payload.numel()}")
    out = decode_rows(payload.reshape(1, -1), numel, wire, dtype).reshape(-1)
    return out.clone() if parse_wire(wire).name == "fp32" else out


__all__ = ["FORMATS", "INT8_CHUNK", "SPARSE_WIRES", "TOPK_FRACTION", "WIRES", "Wire",
           "WireFormat", "check_wire", "decode", "decode_rows", "encode", "encode_rows",
           "parse_wire", "payload_bytes", "reinterpret", "wire_spec"]
