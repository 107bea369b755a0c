"""What a Kaldi output holds, beside it: ``FILE.json`` for each file of ``--out``.

An ``.h5`` output says what it holds in its attributes (``kind``: log-posteriors or
pseudo-log-likelihoods, the priors, the checkpoint, ...). A Kaldi archive cannot, so each
file the user named (the ``.ark``, the ``.scp``) gets a sidecar ``FILE.json`` with the same
attributes and the file's size; ``python -m hadpsgd.decode`` reads it to pick the defaults
that fit the kind of scores (:mod:`hadpsgd.decode.loglikes`), and believes it only while the
file still has that size. Streams (``ark:-``, pipes) get none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hadpsgd.forward.output import FORMAT, OutputSpec, temp_path

SUFFIX = ".json"


def sidecar_of(path: str | os.PathLike[str]) -> Path:
    """The sidecar of an output file: ``FILE.json``."""
    return Path(f"{os.fspath(path)}{SUFFIX}")


def write_sidecars(out: OutputSpec, num_classes: int, attrs: dict[str, Any]) -> list[str]:
    """Write the sidecar of every file of a complete Kaldi output (rank 0, after the merge).

    Returns:
        The sidecars written (none for an ``.h5`` or a stream).
    """
    if out.h5 is not None:
        return []
    written = []
    for path in out.files():  # the plain files, not the streams
        if not path.is_file():
            continue  # under mpirun with an scp the archives are the ranks' (out.<rank>.ark)
        side = sidecar_of(path)
        info = {"format": FORMAT, "num_classes": num_classes, **attrs,
                "file": str(path), "bytes": path.stat().st_size}
        tmp = temp_path(side)
        tmp.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, side)
        written.append(str(side))
    return written
