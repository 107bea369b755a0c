"""The wire table (``hadpsgd.comm.codec.FORMATS``) against its codecs and its readers.

Each record's facts are checked against what its codec does, not against the record: the
payload's size is what ``encode`` makes, ``decode(encode(x))`` is ``x`` for fp32 and within
the format's rounding otherwise, ``bits`` is the measured payload a value, a sparse format
sends fewer values than it codes. The algorithms read the table, not their own lists:
ADPSGD's CHOCO wires, BMUF's recipe block lengths, the ``--wire`` choices and their help.
"""

from __future__ import annotations

import pytest
import torch

from hadpsgd.algorithms.adpsgd import CHOCO_WIRES
from hadpsgd.algorithms.bmuf.options import BMUFOptions
from hadpsgd.algorithms.options import WireOptions
from hadpsgd.comm.codec import (
    FORMATS,
    SPARSE_WIRES,
    WIRES,
    decode,
    encode,
    parse_wire,
    payload_bytes,
    wire_spec,
)
from hadpsgd.config import run_parser


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_record_describes_its_codec(name: str) -> None:
    fmt = FORMATS[name]
    spec = wire_spec(name)
    x = torch.randn(3 * 4096 + 5, generator=torch.Generator().manual_seed(1))
    payload = encode(x, spec)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(x.numel(), spec)
    assert fmt.payload(x.numel(), parse_wire(spec), 4) == payload.numel()
    y = decode(payload, x.numel(), spec, torch.float32)
    err = float((y - x).norm() / x.norm())
    if name == "fp32":
        assert torch.equal(y, x) and not fmt.feedback
    else:  # a rounding format: its error is what feedback carries, and it is not nothing
        assert fmt.feedback and 0 < err < 1.01, err
    # bits a value: the payload measured on a large tensor, within 2 % of the record
    big = 64 * 4096
    assert payload_bytes(big, spec) * 8 / big == pytest.approx(fmt.bits, rel=0.02)
    sent = int((y != 0).sum())
    assert (sent < x.numel() // 2) == fmt.sparse, (name, sent)
    # a sparse format, and only one, has a default fraction (SPARSE_WIRES, --topk-fraction)
    assert (fmt.fraction is not None) == fmt.sparse == (name in SPARSE_WIRES), name


def test_the_algorithms_and_the_flag_read_the_table() -> None:
    assert WIRES == tuple(FORMATS) and WireOptions.__dataclass_fields__["wire"].metadata[
        "choices"] == WIRES
    assert set(CHOCO_WIRES) == {n for n, f in FORMATS.items() if f.differences} == {
        "sign", "topk", "signtopk"}
    # No wire has a block of its own: BMUF's recipe keeps fp32's for all (issue 57)
    assert all("sync_period" not in BMUFOptions.recipe({"wire": name}) for name in FORMATS)
    # --help names every wire in the flag's own text, not only in argparse's list of choices
    text = run_parser().format_help()
    wire_help = text[text.rindex("--wire {"):].split("--topk-fraction")[0]
    assert all(wire_help.count(name) >= 2 for name in FORMATS), wire_help
