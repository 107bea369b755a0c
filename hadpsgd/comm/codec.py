"""The wire formats of the inter-node exchanges: ``fp32``, ``bf16`` and ``int8`` payloads.

``--wire fp32|bf16|int8`` picks what BMUF's block sync and ADPSGD's gossip put on the
inter-node link: the tensor's own bytes (``fp32``, no compression), bfloat16 (2 bytes a
value), or int8 with one fp32 scale per :data:`INT8_CHUNK` values (~1 byte a value). The
payload is a flat ``uint8`` tensor, so MPI moves it as bytes whatever the dtype.

A compressed format rounds; *error feedback* (1-bit Adam, PowerSGD) carries what one exchange
lost into the next: send ``encode(x + e)``, keep ``e = (x + e) - decode(that)``. Over K
exchanges the decoded values then sum to the inputs' sum minus the last residual, which stays
within one rounding step, so nothing is lost for good. The callers keep the residuals
(:class:`~hadpsgd.comm.compressed.CompressedMean`, ADPSGD's gossip); this module only codes.
"""

from __future__ import annotations

import torch

WIRES: tuple[str, ...] = ("fp32", "bf16", "int8")
"""Wire formats; ``fp32`` is the tensor's own dtype, uncompressed."""
INT8_CHUNK = 1024
"""Values per int8 scale. A scale costs 4 bytes, so 1024 values carry 4/1024 = 0.4 % of
overhead (int8 stays at 3.98x below fp32), while a chunk is still small enough that one
large value only coarsens the rounding of its own 1023 neighbours, not of a whole layer."""


def check_wire(wire: str) -> None:
    """Raise ``ValueError`` unless ``wire`` is one of :data:`WIRES`."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")


def payload_bytes(numel: int, wire: str, elem_size: int = 4) -> int:
    """Bytes :func:`encode` makes of ``numel`` values (``elem_size``: the dtype's, for fp32)."""
    check_wire(wire)
    if wire == "fp32":
        return numel * elem_size
    if wire == "bf16":
        return 2 * numel
    return numel + 4 * -(-numel // INT8_CHUNK)


def reinterpret(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes seen as ``dtype`` (a copy where they are not aligned to its size)."""
    if p.shape[-1] == 0:  # torch gives an empty row the stride 1, which no view accepts
        return torch.empty(p.shape, dtype=dtype, device=p.device)
    try:
        return p.view(dtype)
    except RuntimeError:  # a fresh tensor: clone() would keep a size-1 row's odd stride
        return torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(p).view(dtype)


def encode_rows(x: torch.Tensor, wire: str) -> torch.Tensor:
    """Encode each row of the 2-D ``x`` on its own: ``[R, m]`` values -> ``[R, P]`` bytes.

    May return a view of ``x`` (fp32). int8 rows are ``[scales (fp32) | values (int8)]``.
    """
    rows, m = x.shape
    if wire == "fp32":
        return x.contiguous().view(torch.uint8)
    if wire == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    chunks = -(-m // INT8_CHUNK)
    blocks = torch.nn.functional.pad(x.to(torch.float32), (0, chunks * INT8_CHUNK - m))
    blocks = blocks.view(rows, chunks, INT8_CHUNK)
    # amax propagates NaN and abs(-inf) = inf: a non-finite chunk gets a non-finite scale, so
    # it decodes to non-finite values and the trainer's finiteness checks still see it.
    scale = blocks.abs().amax(dim=2).div_(127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero chunk: q = 0
    q = blocks.div_(safe.unsqueeze(2)).round_().clamp_(-127, 127).nan_to_num_(0.0)
    out = torch.empty(rows, 4 * chunks + m, dtype=torch.uint8, device=x.device)
    out[:, :4 * chunks] = scale.view(torch.uint8)
    out[:, 4 * chunks:] = q.view(rows, -1)[:, :m].to(torch.int8).view(torch.uint8)
    return out


def decode_rows(p: torch.Tensor, m: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype`` (may alias)."""
    if wire == "fp32":
        return reinterpret(p, dtype)
    if wire == "bf16":
        return reinterpret(p, torch.bfloat16).to(dtype)
    rows, chunks = p.shape[0], -(-m // INT8_CHUNK)
    scale = reinterpret(p[:, :4 * chunks], torch.float32)
    out = torch.zeros(rows, chunks * INT8_CHUNK, dtype=torch.float32, device=p.device)
    out[:, :m] = p[:, 4 * chunks:].view(torch.int8)
    out.view(rows, chunks, INT8_CHUNK).mul_(scale.unsqueeze(2))
    return out[:, :m].to(dtype)


def encode(x: torch.Tensor, wire: str) -> torch.Tensor:
    """A flat float tensor as a new flat ``uint8`` payload of :func:`payload_bytes` bytes.

    ``fp32``: the raw bytes of ``x`` (its own dtype); ``bf16``: ``x`` rounded to bfloat16;
    ``int8``: per chunk of :data:`INT8_CHUNK` values, ``scale = absmax / 127`` (fp32) and
    ``q = round(x / scale)`` (a zero chunk has scale 0; a non-finite one a non-finite scale).
    Computed on ``x``'s device.
    """
    check_wire(wire)
    out = encode_rows(x.reshape(1, -1), wire).reshape(-1)
    return out.clone() if wire == "fp32" else out


def decode(payload: torch.Tensor, numel: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``numel`` values of ``dtype`` an :func:`encode` payload stands for (a new tensor)."""
    check_wire(wire)
    elem = torch.empty(0, dtype=dtype).element_size()
    if payload.numel() != payload_bytes(numel, wire, elem):
        raise ValueError(f"a {wire} payload of {numel} {dtype} values has "
                         f"{payload_bytes(numel, wire, elem)} bytes, got {payload.numel()}")
    out = decode_rows(payload.reshape(1, -1), numel, wire, dtype).reshape(-1)
    return out.clone() if wire == "fp32" else out


__all__ = ["INT8_CHUNK", "WIRES", "check_wire", "decode", "decode_rows", "encode", "encode_rows",
           "payload_bytes", "reinterpret"]
